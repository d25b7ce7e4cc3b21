"""Infinity's BSQ VAE (``infinity_vae_d32reg.pth`` for Infinity-2B, ``infinity_vae_d56_f8_14_patchify.pth`` for the
8B), in the image-decoder slot: the transformer's bits -> code maps summed over the scales -> images.

What the release's inference does (tools/run_infinity.py builds the VAE; Infinity.autoregressive_infer_cfg runs it):
- a cell's d bits are its code vector: bit j is channel j, 0/1 as -1/+1 times 1/sqrt(d), then l2-normalised (a no-op
  up to rounding, kept for equal rounding); no projection (the codebook width is d itself);
- each scale's codes are upsampled to the last scale's grid, trilinear over (1, h, w) without align_corners (bilinear
  in effect), and summed into f_hat; the last scale's are added as they are; the next scale's input is f_hat
  resampled the same way to that scale's grid (not area-downsampled: that is the encoder's side);
- the image is the decoder of f_hat: LDM's layout (shared/ldm_blocks.py) with no post_quant_conv, no attention, d
  input channels, ``2 ** (levels - 1)`` pixels per cell: 16 for the 2B's (d 32, 5 levels), 8 for the 8B's (d 14,
  4 levels: its transformer pixel-shuffles 2 x 2 cells of 4d = 56 bits, hence, it seems, the file's "d56").

The file is ``torch.save({"vae": state_dict})``; the keys carry Infinity's wrapper modules (``conv_in.conv.weight``,
``norm1.norm.weight``) or, as its loader also reads, not; the encoder and the quantiser's buffer are left out here.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import FastARError
from ..shared.checkpoint import CheckpointInfo, has_prefix, load_weights, select
from ..shared.ldm_blocks import Decoder, KLConfig

RELEASES = {(32, 16): "infinity_vae_d32reg.pth (Infinity-2B's)",
            (14, 8): "infinity_vae_d56_f8_14_patchify.pth (Infinity-8B's)"}  # (d, pixels per cell) -> its file
WRAPPED = re.compile(r"\.(conv|norm)\.(weight|bias)$")  # Infinity's Conv and Normalize wrap the torch layer


def release_name(codebook_dim: int, patch_size: int) -> str:
    return RELEASES.get((codebook_dim, patch_size), f"a d{codebook_dim} VAE with {patch_size} pixels per cell")


@dataclass
class InfinityVAEConfig:
    codebook_dim: int = 32  # d: bits per cell, the code width, the decoder's input channels
    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 2, 4, 4, 4)
    num_res_blocks: int = 2

    def __post_init__(self):
        self.ch_mult = tuple(self.ch_mult)
        odd = [self.ch * m for m in self.ch_mult if (self.ch * m) % 32 and (self.ch * m) % 24]
        if odd:
            raise FastARError(f"Infinity's VAE normalises in groups of 32 or 24 channels; widths {odd} fit neither")

    @property
    def patch_size(self) -> int:
        """Image pixels per latent cell, each way."""
        return 2 ** (len(self.ch_mult) - 1)

    @property
    def downsample(self) -> int:
        """The same, as the pipeline's memory estimate (memory.py) asks every image decoder for it."""
        return self.patch_size

    def blocks(self) -> KLConfig:
        return KLConfig(embed_dim=self.codebook_dim, ch=self.ch, ch_mult=self.ch_mult,
                        num_res_blocks=self.num_res_blocks, with_encoder=False, mid_attention=False)

    @classmethod
    def from_state_dict(cls, sd, source: str) -> "InfinityVAEConfig":
        def count(prefix: str) -> int:
            return len({k[len(prefix):].split(".")[0] for k in sd if k.startswith(prefix)})

        try:
            ch = sd["decoder.conv_out.weight"].shape[1]
            levels = count("decoder.up.")
            mult = tuple(sd[f"decoder.up.{i}.block.0.conv2.weight"].shape[0] // ch for i in range(levels))
            cfg = cls(codebook_dim=sd["decoder.conv_in.weight"].shape[1], ch=ch, ch_mult=mult,
                      num_res_blocks=count("decoder.up.0.block.") - 1)
        except KeyError as e:
            raise FastARError(f"{source} looks like Infinity's VAE but lacks {e.args[0]}: the file is incomplete, "
                              "re-download it") from None
        upsampled = [i for i in range(levels) if has_prefix(sd, f"decoder.up.{i}.upsample.")]
        if upsampled != list(range(1, levels)) or has_prefix(sd, "decoder.mid.attn_1."):
            raise FastARError(f"{source}: its decoder (upsampling at levels {upsampled} of {levels}"
                              f"{', attention in the middle' if has_prefix(sd, 'decoder.mid.attn_1.') else ''}) is not "
                              "the layout of Infinity's released VAEs, the only ones FastAR reads")
        return cfg


def infinity_norm(channels: int) -> nn.GroupNorm:
    """Infinity's ``Normalize``: 32 groups where they divide the channels, else 24."""
    return nn.GroupNorm(32 if channels % 32 == 0 else 24, channels, eps=1e-6, affine=True)


def resized(x: torch.Tensor, size) -> torch.Tensor:
    """``[B, C, h, w]`` resampled to ``size`` as the release does it: trilinear over a one-frame video."""
    if tuple(x.shape[-2:]) == tuple(size):
        return x
    return F.interpolate(x.unsqueeze(2), size=(1, *size), mode="trilinear").squeeze(2)


class InfinityVAE(nn.Module):
    """Each scale's bits ``[B, h, w, d]`` -> f_hat ``[B, d, H, W]`` -> images ``[B, 3, H * p, W * p]``."""

    input_kind = "multi-scale-bits"
    what = "Infinity's BSQ VAE"

    def __init__(self, cfg: InfinityVAEConfig):
        super().__init__()
        self.cfg = cfg
        self.decoder = Decoder(cfg.blocks(), norm=infinity_norm)

    @property
    def device(self) -> torch.device:
        return self.decoder.conv_in.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.conv_in.weight.dtype

    def codebook(self) -> None:
        """None: the 2**d codes are never listed (a code is its bits)."""
        return None

    def codes_of_bits(self, bits: torch.Tensor) -> torch.Tensor:
        """Bits ``[B, h, w, d]`` (0/1; bit j is channel j) -> code vectors ``[B, d, h, w]`` in fp32."""
        d = self.cfg.codebook_dim
        if bits.dim() != 4 or bits.shape[-1] != d:
            raise FastARError(f"{self.what} reads {d} bits per cell as [batch, rows, columns, {d}], not a tensor of "
                              f"shape {tuple(bits.shape)}: pick the VAE the model was trained with")
        scale = 1 / math.sqrt(d)
        codes = bits.float() * scale * 2 - scale  # the release's order of operations, for equal rounding
        return F.normalize(codes, dim=-1).permute(0, 3, 1, 2)

    def next_input(self, f_hat: torch.Tensor, bits: torch.Tensor, scale: int,
                   shapes) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Scale ``scale``'s bits added to f_hat ``[B, d, H, W]`` (zeros before the first; (H, W) = shapes[-1]);
        returns (f_hat, the next scale's input ``[B, d, h', w']`` at shapes[scale + 1], or None after the last)."""
        shapes = [tuple(s) for s in shapes]
        if tuple(bits.shape[1:3]) != shapes[scale] or tuple(f_hat.shape[-2:]) != shapes[-1]:
            raise FastARError(f"scale {scale}: bits of a {tuple(bits.shape[1:3])} grid and f_hat of "
                              f"{tuple(f_hat.shape[-2:])} do not fit the scales {shapes}")
        f_hat = f_hat.float() + resized(self.codes_of_bits(bits), shapes[-1])
        if scale + 1 == len(shapes):
            return f_hat, None
        return f_hat, resized(f_hat, shapes[scale + 1])

    def decode(self, f_hat: torch.Tensor) -> torch.Tensor:
        """The image-decoder protocol: f_hat ``[B, d, H, W]`` -> images in [-1, 1], not clamped (the release clamps;
        the pipeline does)."""
        return self.decoder(f_hat.to(self.dtype))


def check_image_decoder(decoder, codebook_dim: int, patch_size: int, model_what: str) -> None:
    """An Infinity model's image decoder must be the BSQ VAE it was trained with: ``codebook_dim`` bits per cell at
    the VAE's grid (the 8B's 4d bits per token are 2 x 2 cells of d), ``patch_size`` pixels per cell."""
    want = release_name(codebook_dim, patch_size)
    if getattr(decoder, "input_kind", None) != InfinityVAE.input_kind:
        raise FastARError(f"{model_what} writes bits over its scales: its image decoder is {want}, not {decoder.what}")
    have = (decoder.cfg.codebook_dim, decoder.cfg.patch_size)
    if have != (codebook_dim, patch_size):
        raise FastARError(f"{model_what} works with {want}, with {codebook_dim} bits and {patch_size} pixels per "
                          f"cell; this VAE is {release_name(*have)}: load the model's own")


def decoder_weights(sd) -> dict:
    """The decoder's weights under FastAR's names (``{name: stored name}``): Infinity's wrapper modules unwrapped."""
    wrapped = "decoder.conv_in.conv.weight" in sd
    return {WRAPPED.sub(r".\2", k) if wrapped else k: k for k in sd if k.startswith("decoder.")}


def load_infinity_vae(sd, *, info: CheckpointInfo, device="cpu", dtype=torch.float32) -> InfinityVAE:
    """Infinity's BSQ VAE (its decoding side) in eval mode, sizes read off the weights."""
    weights = select(sd, decoder_weights(sd))
    cfg = InfinityVAEConfig.from_state_dict(weights, info.source)
    with torch.device("meta"):
        model = InfinityVAE(cfg)
    load_weights(model, weights, info.source)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)
