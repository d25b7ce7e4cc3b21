"""The KL autoencoder of MAR (LDM's AutoencoderKL, e.g. KL-16), in the image-decoder slot.

Key names follow LDM (``decoder.up.{level}.block.{i}``, ``decoder.mid.block_1``, ``post_quant_conv``);
the building blocks are the same as LlamaGen's VQ (GroupNorm 32, eps 1e-6, SiLU, single-head attention).
The sizes are read off the weight shapes: width, channel multipliers, residual blocks per level, latent
channels, and where attention sits. The encoder is optional (decoding needs only the decoder); its
posterior mean is what ``encode`` returns.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import FastARError
from ..shared.checkpoint import has_prefix
from ..llamagen.vq import AttnBlock, Downsample, ResnetBlock, Upsample, group_norm


@dataclass
class KLConfig:
    embed_dim: int = 16
    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    num_res_blocks: int = 2
    encoder_attn_levels: tuple[int, ...] = (4,)  # KL-16 attends at its lowest resolution
    decoder_attn_levels: tuple[int, ...] = ()
    with_encoder: bool = True

    def __post_init__(self):
        self.ch_mult = tuple(self.ch_mult)
        self.encoder_attn_levels = tuple(self.encoder_attn_levels)
        self.decoder_attn_levels = tuple(self.decoder_attn_levels)

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)

    @classmethod
    def from_state_dict(cls, sd: dict, source: str) -> "KLConfig":
        def count(prefix: str) -> int:
            return len({k[len(prefix):].split(".")[0] for k in sd if k.startswith(prefix)})

        def attn_levels(levels: str) -> tuple[int, ...]:  # "encoder.down" or "decoder.up"
            return tuple(i for i in range(count(f"{levels}.")) if has_prefix(sd, f"{levels}.{i}.attn."))

        try:
            ch = sd["decoder.conv_out.weight"].shape[1]
            levels = count("decoder.up.")
            mult = tuple(sd[f"decoder.up.{i}.block.0.conv2.weight"].shape[0] // ch for i in range(levels))
            return cls(embed_dim=sd["post_quant_conv.weight"].shape[0], ch=ch, ch_mult=mult,
                       num_res_blocks=count("decoder.up.0.block.") - 1,
                       encoder_attn_levels=attn_levels("encoder.down"), decoder_attn_levels=attn_levels("decoder.up"),
                       with_encoder="encoder.conv_in.weight" in sd)
        except KeyError as e:
            raise FastARError(f"{source} looks like a KL autoencoder but lacks {e.args[0]}: the file is "
                              "incomplete, re-download it") from None


class Level(nn.Module):
    """One resolution of the LDM layout: ``block.{i}``, ``attn.{i}`` after each block, resampling."""

    def __init__(self, cin: int, cout: int, blocks: int, attn: bool, resample: type | None):
        super().__init__()
        self.block = nn.ModuleList(ResnetBlock(cin if i == 0 else cout, cout) for i in range(blocks))
        self.attn = nn.ModuleList(AttnBlock(cout) for _ in range(blocks if attn else 0))
        if resample is Downsample:
            self.downsample = Downsample(cout)
        elif resample is Upsample:
            self.upsample = Upsample(cout)

    def forward(self, x):
        for i, block in enumerate(self.block):
            x = block(x)
            if len(self.attn):
                x = self.attn[i](x)
        for name in ("downsample", "upsample"):
            if hasattr(self, name):
                x = getattr(self, name)(x)
        return x


class Middle(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.block_1 = ResnetBlock(channels, channels)
        self.attn_1 = AttnBlock(channels)
        self.block_2 = ResnetBlock(channels, channels)

    def forward(self, x):
        return self.block_2(self.attn_1(self.block_1(x)))


class Encoder(nn.Module):
    """LDM's encoder; ``out_channels``: the posterior's mean and log-variance (2 x embed_dim) for the KL
    autoencoder, the latent for a VQGAN."""

    def __init__(self, cfg: KLConfig, out_channels: int):
        super().__init__()
        widths = [cfg.ch * m for m in cfg.ch_mult]
        last = len(widths) - 1
        self.conv_in = nn.Conv2d(3, cfg.ch, 3, padding=1)
        self.down = nn.ModuleList(
            Level(cfg.ch if i == 0 else widths[i - 1], widths[i], cfg.num_res_blocks, i in cfg.encoder_attn_levels,
                  Downsample if i != last else None) for i in range(len(widths)))
        self.mid = Middle(widths[-1])
        self.norm_out = group_norm(widths[-1])
        self.conv_out = nn.Conv2d(widths[-1], out_channels, 3, padding=1)

    def forward(self, x):
        x = self.conv_in(x)
        for level in self.down:
            x = level(x)
        return self.conv_out(F.silu(self.norm_out(self.mid(x))))


class Decoder(nn.Module):
    def __init__(self, cfg: KLConfig):
        super().__init__()
        widths = [cfg.ch * m for m in cfg.ch_mult]
        self.conv_in = nn.Conv2d(cfg.embed_dim, widths[-1], 3, padding=1)
        self.mid = Middle(widths[-1])
        # up[i] works at level i's resolution; they run from the lowest resolution (the last) to up[0]
        self.up = nn.ModuleList(
            Level(widths[min(i + 1, len(widths) - 1)], widths[i], cfg.num_res_blocks + 1, i in cfg.decoder_attn_levels,
                  Upsample if i != 0 else None) for i in range(len(widths)))
        self.norm_out = group_norm(widths[0])
        self.conv_out = nn.Conv2d(widths[0], 3, 3, padding=1)

    def forward(self, z):
        x = self.mid(self.conv_in(z))
        for level in reversed(self.up):
            x = level(x)
        return self.conv_out(F.silu(self.norm_out(x)))


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
