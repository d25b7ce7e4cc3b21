"""LlamaGen VQ tokenizer (VQ-16 family, also Janus's generation decoder), with the width as a parameter.

Key names follow the official checkpoints. The codebook is L2-normalised at lookup. The encoder is
optional: the pack only decodes, the demo training tool also encodes.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..shared.ldm_blocks import AttnBlock, Downsample, ResnetBlock, Upsample, group_norm


@dataclass
class VQConfig:
    codebook_size: int = 16384
    embed_dim: int = 8
    z_channels: int = 256
    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    num_res_blocks: int = 2
    with_encoder: bool = True
    # encode each downsample x downsample patch on its own (the demo VQ): a code then depends on its
    # patch's pixels alone, so equal patches get equal codes and an AR model sees no arbitrary synonyms
    patch_encoder: bool = False

    def __post_init__(self):
        self.ch_mult = tuple(self.ch_mult)

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)

    @classmethod
    def from_state_dict(cls, sd: dict) -> "VQConfig":
        """Read the architecture off the decoder's weight shapes."""
        levels = 1 + max(int(m.group(1)) for k in sd if (m := re.match(r"decoder\.conv_blocks\.(\d+)\.", k)))
        res = 1 + max(int(m.group(1)) for k in sd if (m := re.match(r"decoder\.conv_blocks\.0\.res\.(\d+)\.", k)))
        widths = [sd[f"decoder.conv_blocks.{levels - 1 - j}.res.0.conv2.weight"].shape[0] for j in range(levels)]
        ch = widths[0]
        codebook = sd["quantize.embedding.weight"]
        return cls(
            codebook_size=codebook.shape[0],
            embed_dim=codebook.shape[1],
            z_channels=sd["post_quant_conv.weight"].shape[0],
            ch=ch,
            ch_mult=tuple(w // ch for w in widths),
            num_res_blocks=res - 1,
            with_encoder=any(k.startswith("encoder.") for k in sd),
        )


def middle(channels: int) -> nn.ModuleList:
    return nn.ModuleList([ResnetBlock(channels, channels), AttnBlock(channels), ResnetBlock(channels, channels)])


class Level(nn.Module):
    """One resolution: residual blocks, attention after each at the lowest resolution, resampling."""

    def __init__(self, cin, cout, blocks, attn, resample):
        super().__init__()
        self.res = nn.ModuleList(ResnetBlock(cin if i == 0 else cout, cout) for i in range(blocks))
        self.attn = nn.ModuleList(AttnBlock(cout) for _ in range(blocks if attn else 0))
        if resample is Upsample:
            self.upsample = Upsample(cout)
        elif resample is Downsample:
            self.downsample = Downsample(cout)

    def forward(self, x):
        for i, block in enumerate(self.res):
            x = block(x)
            if len(self.attn):
                x = self.attn[i](x)
        for name in ("upsample", "downsample"):
            if hasattr(self, name):
                x = getattr(self, name)(x)
        return x


class Encoder(nn.Module):
    def __init__(self, cfg: VQConfig):
        super().__init__()
        n = len(cfg.ch_mult)
        widths = [cfg.ch * m for m in cfg.ch_mult]
        self.conv_in = nn.Conv2d(3, cfg.ch, 3, padding=1)
        self.conv_blocks = nn.ModuleList(
            Level(
                cfg.ch * ((1,) + cfg.ch_mult)[i], widths[i], cfg.num_res_blocks,
                attn=i == n - 1, resample=Downsample if i != n - 1 else None,
            )
            for i in range(n)
        )
        self.mid = middle(widths[-1])
        self.norm_out = group_norm(widths[-1])
        self.conv_out = nn.Conv2d(widths[-1], cfg.z_channels, 3, padding=1)

    def forward(self, x):
        h = self.conv_in(x)
        for level in self.conv_blocks:
            h = level(h)
        for block in self.mid:
            h = block(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class Decoder(nn.Module):
    def __init__(self, cfg: VQConfig):
        super().__init__()
        n = len(cfg.ch_mult)
        widths = [cfg.ch * m for m in reversed(cfg.ch_mult)]  # deepest first
        self.conv_in = nn.Conv2d(cfg.z_channels, widths[0], 3, padding=1)
        self.mid = middle(widths[0])
        self.conv_blocks = nn.ModuleList(
            Level(
                widths[max(i - 1, 0)], widths[i], cfg.num_res_blocks + 1,
                attn=i == 0, resample=Upsample if i != n - 1 else None,
            )
            for i in range(n)
        )
        self.norm_out = group_norm(widths[-1])
        self.conv_out = nn.Conv2d(widths[-1], 3, 3, padding=1)

    def forward(self, z):
        h = self.conv_in(z)
        for block in self.mid:
            h = block(h)
        for level in self.conv_blocks:
            h = level(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class VectorQuantizer(nn.Module):
    def __init__(self, codebook_size: int, embed_dim: int):
        super().__init__()
        self.embedding = nn.Embedding(codebook_size, embed_dim)

    def codebook(self) -> torch.Tensor:
        """The code vectors as the decoder sees them (L2-normalised)."""
        return F.normalize(self.embedding.weight, dim=-1)

    def nearest(self, z: torch.Tensor) -> torch.Tensor:
        """Codes of ``z`` [B, C, H, W] -> [B, H, W]."""
        flat = F.normalize(z.permute(0, 2, 3, 1), dim=-1)
        return torch.cdist(flat.flatten(0, 2), self.codebook()).argmin(-1).view(flat.shape[:3])

    def lookup(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes [B, H, W] -> vectors [B, C, H, W]."""
        return self.codebook()[codes].permute(0, 3, 1, 2)


class VQModel(nn.Module):
    def __init__(self, cfg: VQConfig):
        super().__init__()
        self.cfg = cfg
        if cfg.with_encoder:
            self.encoder = Encoder(cfg)
            self.quant_conv = nn.Conv2d(cfg.z_channels, cfg.embed_dim, 1)
        self.quantize = VectorQuantizer(cfg.codebook_size, cfg.embed_dim)
        self.post_quant_conv = nn.Conv2d(cfg.embed_dim, cfg.z_channels, 1)
        self.decoder = Decoder(cfg)

    @property
    def device(self) -> torch.device:
        return self.post_quant_conv.weight.device

    def encode_latent(self, images: torch.Tensor) -> torch.Tensor:
        """Images in [-1, 1] -> continuous latents before quantisation."""
        if not self.cfg.with_encoder:
            raise RuntimeError("this VQ checkpoint has no encoder weights")
        if not self.cfg.patch_encoder:
            return self.quant_conv(self.encoder(images))
        b, c, height, width = images.shape
        ds = self.cfg.downsample
        h, w = height // ds, width // ds
        patches = images.reshape(b, c, h, ds, w, ds).permute(0, 2, 4, 1, 3, 5).reshape(b * h * w, c, ds, ds)
        # flat images repeat most patches; encoding each distinct patch once is the same result, faster
        distinct, where = torch.unique(patches.flatten(1), dim=0, return_inverse=True)
        latents = self.quant_conv(self.encoder(distinct.reshape(-1, c, ds, ds)))[where]  # [b*h*w, D, 1, 1]
        return latents.reshape(b, h, w, -1).permute(0, 3, 1, 2)

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Images in [-1, 1] -> codes [B, H/ds, W/ds]."""
        return self.quantize.nearest(self.encode_latent(images))

    def decode_vectors(self, vectors: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.post_quant_conv(vectors))

    input_kind = "codes"
    what = "a VQ tokenizer"

    def decode(self, inputs: torch.Tensor) -> torch.Tensor:
        """The image-decoder protocol: codes [B, h, w], or code-space latents [B, C, h, w] taken as they are
        (a DD student's continuous outputs) -> images in [-1, 1] (not clamped)."""
        if inputs.is_floating_point():
            return self.decode_vectors(inputs.to(self.device, self.post_quant_conv.weight.dtype))
        return self.decode_codes(inputs)

    def codebook(self) -> torch.Tensor:
        """The code vectors as the decoder uses them (LANTERN's latent space)."""
        return self.quantize.codebook().detach()

    def decode_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes [B, h, w] -> images [B, 3, h*ds, w*ds] in [-1, 1] (not clamped)."""
        vectors = self.quantize.lookup(codes.to(self.device))
        return self.decode_vectors(vectors.to(self.post_quant_conv.weight.dtype))
