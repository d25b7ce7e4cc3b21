"""VAR's multi-scale residual VQVAE (``vae_ch160v4096z32.pth``), in the image-decoder slot.

The encoder and decoder are the LDM layout of the KL autoencoder (the release fuses each attention's q, k, v
into one ``qkv`` conv: split on load, fused again on save), with 3x3 ``quant_conv`` and ``post_quant_conv``
and a 4096 x 32 codebook used as it is (not normalised). The quantiser works over ``patch_nums`` scales:
- scale k's token map (its code vectors, ``[B, C, pn, pn]``) is bicubic-upsampled to the final size (the
  last scale is already there), passed through one of the shared Phi convs, ``Phi(h) = (1 - r) h + r conv(h)``
  with r = 0.5, and added to the running sum f_hat;
- scale k uses Phi ``argmin |ticks - k / (S - 1)|`` (ticks: ``linspace(1/12, 11/12, 4)`` for the release's
  four, ``linspace(1/2n, 1 - 1/2n, n)`` otherwise; float64, the first minimum on ties, as the release);
- the next scale's input is f_hat area-downsampled to its size; the image is ``decoder(post_quant_conv(f_hat))``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ...errors import FastARError
from ..shared.codebook import nearest_codes
from ..shared.ldm_blocks import Decoder, Encoder, VQGANConfig

VAR_PATCH_NUMS = (1, 2, 3, 4, 5, 6, 8, 10, 13, 16)  # the release's 256 px scales


@dataclass
class VQVAEConfig(VQGANConfig):
    """The VQGAN's layout (code width = latent width here) plus the shared Phi convs."""

    codebook_size: int = 4096
    embed_dim: int = 32  # code width
    z_channels: int = 32  # latent width: the same
    ch: int = 160
    encoder_attn_levels: tuple[int, ...] = (4,)
    decoder_attn_levels: tuple[int, ...] = (4,)
    phis: int = 4  # shared Phi convs (share_quant_resi)
    resi_ratio: float = 0.5
    patch_nums: tuple[int, ...] = VAR_PATCH_NUMS  # the scales (v_patch_nums): how a token sequence splits

    def __post_init__(self):
        super().__post_init__()
        self.patch_nums = tuple(self.patch_nums)

    @classmethod
    def from_state_dict(cls, sd: dict, source: str, what: str = "a VAR VQVAE", **extra) -> "VQVAEConfig":
        phis = len({k.split(".")[3] for k in sd if k.startswith("quantize.quant_resi.qresi_ls.")})
        if not phis:
            raise FastARError(f"{source}: this VQVAE has no shared Phi convs (quantize.quant_resi.qresi_ls.*); FastAR "
                              "reads the release's layout (share_quant_resi = 4)")
        return super().from_state_dict(sd, source, what, phis=phis, **extra)


def phi_index(scale: int, scales: int, phis: int) -> int:
    """Which shared Phi conv scale ``scale`` of ``scales`` uses."""
    margin = 1 / (3 * phis) if phis == 4 else 1 / (2 * phis)
    ticks = np.linspace(margin, 1 - margin, phis)
    return int(np.argmin(np.abs(ticks - scale / (scales - 1))))


class Phi(nn.Conv2d):
    def __init__(self, channels: int, ratio: float):
        super().__init__(channels, channels, 3, padding=1)
        self.ratio = ratio

    def forward(self, h):
        return h * (1 - self.ratio) + super().forward(h) * self.ratio


class PhiShared(nn.Module):
    """``quant_resi``: its convs under ``qresi_ls.{i}``."""

    def __init__(self, channels: int, count: int, ratio: float):
        super().__init__()
        self.qresi_ls = nn.ModuleList(Phi(channels, ratio) for _ in range(count))


class MultiScaleQuantizer(nn.Module):
    def __init__(self, cfg: VQVAEConfig):
        super().__init__()
        self.embedding = nn.Embedding(cfg.codebook_size, cfg.z_channels)
        self.quant_resi = PhiShared(cfg.z_channels, cfg.phis, cfg.resi_ratio)

    def nearest(self, z: torch.Tensor) -> torch.Tensor:
        """Codes ``[B, h, w]`` of ``[B, C, h, w]``."""
        return nearest_codes(z, self.embedding.weight)

    def add_scale(self, f_hat: torch.Tensor, h: torch.Tensor, scale: int, scales: int) -> torch.Tensor:
        """f_hat plus scale ``scale``'s contribution, its code vectors ``h`` [B, C, pn, pn]."""
        if h.shape[-2:] != f_hat.shape[-2:]:
            h = F.interpolate(h, size=f_hat.shape[-2:], mode="bicubic")
        phi = self.quant_resi.qresi_ls[phi_index(scale, scales, len(self.quant_resi.qresi_ls))]
        return f_hat + phi(h.to(phi.weight.dtype))


class MultiScaleVQVAE(nn.Module):
    """Token maps of ``patch_nums`` scales <-> f_hat ``[B, C, h, w]`` <-> images in [-1, 1]."""

    input_kind = "multi-scale"
    what = "a multi-scale VQVAE (VAR)"

    def __init__(self, cfg: VQVAEConfig):
        super().__init__()
        self.cfg = cfg
        if cfg.with_encoder:
            self.encoder = Encoder(cfg.blocks(), cfg.z_channels)
            self.quant_conv = nn.Conv2d(cfg.z_channels, cfg.z_channels, 3, padding=1)
        self.quantize = MultiScaleQuantizer(cfg)
        self.post_quant_conv = nn.Conv2d(cfg.z_channels, cfg.z_channels, 3, padding=1)
        self.decoder = Decoder(cfg.blocks())

    @property
    def device(self) -> torch.device:
        return self.post_quant_conv.weight.device

    def codebook(self) -> torch.Tensor:
        """The code vectors as the decoder uses them (raw: VAR does not normalise them)."""
        return self.quantize.embedding.weight

    def decode(self, inputs: torch.Tensor) -> torch.Tensor:
        """The image-decoder protocol: f_hat [B, C, h, w], or every scale's vectors [B, L, C] in the scales'
        order (a VAR-DD student's output, accumulated here) -> images in [-1, 1] (not clamped)."""
        f_hat = self.sequence_to_f_hat(inputs) if inputs.dim() == 3 else inputs
        return self.decoder(self.post_quant_conv(f_hat.to(self.post_quant_conv.weight.dtype)))

    def sequence_to_f_hat(self, sequence: torch.Tensor) -> torch.Tensor:
        """Every scale's vectors ``[B, L, C]`` (codes or continuous) -> f_hat."""
        patch_nums = self.cfg.patch_nums
        if sequence.shape[1] != sum(p * p for p in patch_nums):
            raise FastARError(f"{sequence.shape[1]} tokens do not fill this VQVAE's scales {list(patch_nums)}: pick "
                              "the VQVAE of the model's teacher")
        B, side = sequence.shape[0], patch_nums[-1]
        f_hat = torch.zeros(B, self.cfg.z_channels, side, side, device=sequence.device)
        for scale, part in enumerate(sequence.split([p * p for p in patch_nums], dim=1)):
            h = part.transpose(1, 2).reshape(B, -1, patch_nums[scale], patch_nums[scale])
            f_hat, _ = self.add_vectors(f_hat, h, scale, patch_nums)
        return f_hat

    def next_input(self, f_hat: torch.Tensor, codes: torch.Tensor, scale: int, patch_nums) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale ``scale``'s codes ``[B, pn, pn]`` added to f_hat; returns (f_hat, the next scale's input
        ``[B, pn'^2, C]``, or None after the last scale)."""
        h = self.quantize.embedding(codes.long()).permute(0, 3, 1, 2)
        return self.add_vectors(f_hat, h, scale, patch_nums)

    def add_vectors(self, f_hat, h, scale: int, patch_nums):
        """As ``next_input`` from code vectors (or continuous vectors) ``h`` [B, C, pn, pn]."""
        f_hat = self.quantize.add_scale(f_hat.float(), h.float(), scale, len(patch_nums)).float()
        if scale + 1 == len(patch_nums):
            return f_hat, None
        size = patch_nums[scale + 1]
        return f_hat, F.interpolate(f_hat, size=(size, size), mode="area").flatten(2).transpose(1, 2)

    def encode_scales(self, images: torch.Tensor, patch_nums) -> list[torch.Tensor]:
        """Images in [-1, 1] -> each scale's codes ``[B, pn, pn]`` (the release's residual quantisation)."""
        if not self.cfg.with_encoder:
            raise FastARError("this VQVAE file has no encoder weights: it can only decode")
        rest = self.quant_conv(self.encoder(images)).float()
        f_hat, codes = torch.zeros_like(rest), []
        for scale, pn in enumerate(patch_nums):
            z = rest if scale + 1 == len(patch_nums) else F.interpolate(rest, size=(pn, pn), mode="area")
            codes.append(self.quantize.nearest(z))
            h = self.quantize.embedding(codes[-1]).permute(0, 3, 1, 2).float()
            added = self.quantize.add_scale(torch.zeros_like(f_hat), h, scale, len(patch_nums)).float()
            f_hat, rest = f_hat + added, rest - added
        return codes

    def teacher_inputs(self, codes: list[torch.Tensor], patch_nums) -> tuple[torch.Tensor, torch.Tensor]:
        """Every scale's codes -> (the VAR inputs of scales 1.. ``[B, L - 1, C]``, the final f_hat)."""
        f_hat = torch.zeros(codes[0].shape[0], self.cfg.z_channels, *codes[-1].shape[-2:], device=self.device)
        inputs = []
        for scale, c in enumerate(codes):
            f_hat, nxt = self.next_input(f_hat, c, scale, patch_nums)
            if nxt is not None:
                inputs.append(nxt)
        return torch.cat(inputs, dim=1), f_hat


def split_fused_attention(sd: dict) -> dict:
    """The release's fused ``attn.qkv`` (3C, q then k then v) as the q/k/v convs FastAR's blocks have."""
    out = {}
    for key, value in sd.items():
        if ".qkv." in key:
            for name, part in zip("qkv", value.chunk(3, dim=0)):
                out[key.replace(".qkv.", f".{name}.")] = part
        else:
            out[key] = value
    return out


def fuse_attention(sd: dict) -> dict:
    """The inverse of ``split_fused_attention``: the release's key names and shapes."""
    out = {}
    for key, value in sd.items():
        if ".q." in key:
            parts = [sd[key.replace(".q.", f".{name}.")] for name in "qkv"]
            out[key.replace(".q.", ".qkv.")] = torch.cat(parts, dim=0)
        elif ".k." not in key and ".v." not in key:
            out[key] = value
    return out
