"""The KL autoencoder of MAR (LDM's AutoencoderKL, e.g. KL-16), in the image-decoder slot.

Key names follow LDM (``decoder.up.{level}.block.{i}``, ``decoder.mid.block_1``, ``post_quant_conv``);
the building blocks are the same as LlamaGen's VQ (GroupNorm 32, eps 1e-6, SiLU, single-head attention).
The sizes are read off the weight shapes: width, channel multipliers, residual blocks per level, latent
channels, and where attention sits. The encoder is optional (decoding needs only the decoder); its
posterior mean is what ``encode`` returns.
"""
from __future__ import annotations

import torch
from torch import nn

from ...errors import FastARError
from ..shared.ldm_blocks import Decoder, Encoder, KLConfig


class KLAutoencoder(nn.Module):
    """Latents ``[B, embed_dim, h, w]`` <-> images ``[B, 3, h*ds, w*ds]`` in [-1, 1]."""

    def __init__(self, cfg: KLConfig):
        super().__init__()
        self.cfg = cfg
        if cfg.with_encoder:
            self.encoder = Encoder(cfg, 2 * cfg.embed_dim)
            self.quant_conv = nn.Conv2d(2 * cfg.embed_dim, 2 * cfg.embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(cfg.embed_dim, cfg.embed_dim, 1)
        self.decoder = Decoder(cfg)

    @property
    def device(self) -> torch.device:
        return self.post_quant_conv.weight.device

    def encode_moments(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The posterior's mean and log-variance (clamped to [-30, 20], as LDM does)."""
        if not self.cfg.with_encoder:
            raise FastARError("this KL autoencoder file has no encoder weights: it can only decode")
        mean, logvar = self.quant_conv(self.encoder(images)).chunk(2, dim=1)
        return mean, logvar.clamp(-30.0, 20.0)

    input_kind = "latents"
    what = "a KL autoencoder"

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """The image-decoder protocol: latents [B, C, h, w] -> images in [-1, 1] (not clamped)."""
        return self.decode_latents(latents)

    def codebook(self) -> None:
        return None  # continuous latents: no codes

    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.post_quant_conv(latents.to(self.post_quant_conv.weight.dtype)))
