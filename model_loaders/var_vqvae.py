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

from ..errors import FastARError
from .kl_vae import Decoder, Encoder, KLConfig

VAR_PATCH_NUMS = (1, 2, 3, 4, 5, 6, 8, 10, 13, 16)  # the release's 256 px scales


@dataclass
class VQVAEConfig:
    codebook_size: int = 4096
    z_channels: int = 32  # code width = latent width
    ch: int = 160
    ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    num_res_blocks: int = 2
    encoder_attn_levels: tuple[int, ...] = (4,)
    decoder_attn_levels: tuple[int, ...] = (4,)
    phis: int = 4  # shared Phi convs (share_quant_resi)
    resi_ratio: float = 0.5
    with_encoder: bool = True

    def __post_init__(self):
        for name in ("ch_mult", "encoder_attn_levels", "decoder_attn_levels"):
            setattr(self, name, tuple(getattr(self, name)))

    @property
    def embed_dim(self) -> int:
        return self.z_channels

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)

    def blocks(self) -> KLConfig:
        return KLConfig(embed_dim=self.z_channels, ch=self.ch, ch_mult=self.ch_mult, num_res_blocks=self.num_res_blocks,
                        encoder_attn_levels=self.encoder_attn_levels, decoder_attn_levels=self.decoder_attn_levels,
                        with_encoder=self.with_encoder)

    @classmethod
    def from_state_dict(cls, sd: dict, source: str) -> "VQVAEConfig":
        try:
            kl = KLConfig.from_state_dict(sd, source)
            codebook = sd["quantize.embedding.weight"]
        except KeyError as e:
            raise FastARError(f"{source} looks like a VAR VQVAE but lacks {e.args[0]}: the file is incomplete, "
                              "re-download it") from None
        phis = len({k.split(".")[3] for k in sd if k.startswith("quantize.quant_resi.qresi_ls.")})
        if not phis:
            raise FastARError(f"{source}: this VQVAE has no shared Phi convs (quantize.quant_resi.qresi_ls.*); FastAR "
                              "reads the release's layout (share_quant_resi = 4)")
        return cls(codebook_size=codebook.shape[0], z_channels=codebook.shape[1], ch=kl.ch, ch_mult=kl.ch_mult,
                   num_res_blocks=kl.num_res_blocks, encoder_attn_levels=kl.encoder_attn_levels,
                   decoder_attn_levels=kl.decoder_attn_levels, phis=phis, with_encoder=kl.with_encoder)


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
        """Codes ``[B, h, w]`` of ``[B, C, h, w]``: the nearest code vector in squared L2 (lowest index on ties)."""
        flat = z.permute(0, 2, 3, 1).reshape(-1, z.shape[1]).float()
        book = self.embedding.weight.float()
        distances = flat.pow(2).sum(1, keepdim=True) + book.pow(2).sum(1) - 2 * flat @ book.T
        return distances.argmin(1).view(z.shape[0], *z.shape[2:])

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

    def decode(self, f_hat: torch.Tensor) -> torch.Tensor:
        """The image-decoder protocol: f_hat [B, C, h, w] -> images in [-1, 1] (not clamped)."""
        return self.decoder(self.post_quant_conv(f_hat.to(self.post_quant_conv.weight.dtype)))

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
