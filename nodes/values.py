"""What travels between FastAR nodes (the payloads of the custom socket types). Plain data, no ComfyUI.

ComfyUI caches node outputs, so these objects are shared between runs: nodes never mutate them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Socket type names, as they appear in /object_info and in saved workflows: never rename them.
MODEL_TYPE = "FASTAR_MODEL"
VQ_TYPE = "FASTAR_VQ"
DRAFTER_TYPE = "FASTAR_DRAFTER"
CONDITIONING_TYPE = "FASTAR_CONDITIONING"
TOKENS_TYPE = "FASTAR_TOKENS"
STATS_TYPE = "FASTAR_STATS"


@dataclass(frozen=True)
class ModelHandle:
    """A loaded model (AR model or VQ decoder) under ComfyUI's memory management."""

    patcher: object  # a comfy ModelPatcher whose .model is a nodes.comfy_glue.Holder
    name: str  # the file or folder name, for messages

    @property
    def module(self) -> torch.nn.Module:
        """The FastAR model itself (LlamaGenGPT, VQModel)."""
        return self.patcher.model.inner


@dataclass(frozen=True)
class DrafterHandle:
    """A loaded drafter, bound to the AR model it was loaded for (an EAGLE head drafts through that
    model's hidden states and output head), its weights under ComfyUI's memory management."""

    patcher: object  # a comfy ModelPatcher over the drafter's weights (a nodes.comfy_glue.Holder)
    drafter: object  # the samplers' Drafter
    target: torch.nn.Module  # the AR model it is bound to
    name: str

    @property
    def weights(self) -> torch.nn.Module:
        """The drafter's own weights (an EagleHead, or a small LlamaGenGPT)."""
        return self.patcher.model.inner


@dataclass(frozen=True)
class Conditioning:
    """Conditioning for one image; the sampler repeats it over its batch. ``rows`` is a protocol
    conditioning (ClassConditioning or CaptionConditioning) with one row, on the CPU."""

    model_type: str  # pipeline.conditioning_type of the model it is for: "c2i", "t2i" or "prompt"
    rows: object
    label: str  # how the stats and messages name it ("class 3 (ring)", "text: a red cube")


@dataclass(frozen=True)
class Tokens:
    """Image codes in raster order, ``codes`` [B, h*w] int64 on the CPU (a token model's output)."""

    codes: torch.Tensor
    grid: tuple[int, int]
    vocab_size: int


@dataclass(frozen=True)
class Latents:
    """A continuous output as its image decoder reads it, ``latents`` [B, C, h, w] float32 on the CPU: a MAR
    model's tokens divided by its scale factor (for its KL autoencoder), a DD student's code-space vectors
    (for its teacher's VQ decoder), a VAR model's f_hat (for its multi-scale VQVAE) or an Infinity model's (for its BSQ VAE).
    Travels in the same socket as ``Tokens``."""

    latents: torch.Tensor
    source: str = "mar"  # "mar", "dd", "var" or "infinity": which kind of image decoder reads them
