"""The convolutional image decoders' building blocks (LlamaGen's VQ, LDM's KL autoencoder, Chameleon's VQGAN,
VAR's VQVAE, Emu3's vision tokenizer, Infinity's BSQ VAE, whose decoder's middle does not attend): GroupNorm 32 at
eps 1e-6, SiLU residual blocks, single-head attention, 2x resampling; LDM's encoder and decoder stacks (``KLConfig``
describes them, read off the weights) and the config of a VQ model on them (``VQGANConfig``: Chameleon's VQGAN,
extended by VAR's VQVAE).

The norm is a parameter (``norm(channels)`` makes one; GroupNorm by default): Emu3's decoder conditions every norm on
the code vectors (a spatial norm), so the blocks pass what follows ``x`` in their ``forward`` (``*cond``) on to their
norms, and a GroupNorm is given nothing there."""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import nn

from ...errors import FastARError
from .checkpoint import has_prefix


def group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(32, channels, eps=1e-6, affine=True)


def conv3x3(cin: int, cout: int) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, padding=1)


class ResnetBlock(nn.Module):
    """``conv``: its two 3x3 convolutions, same-size (Emu3's temporal blocks, which keep their width, give causal 3-D
    ones)."""

    def __init__(self, cin: int, cout: int, norm=group_norm, conv=conv3x3):
        super().__init__()
        self.norm1 = norm(cin)
        self.conv1 = conv(cin, cout)
        self.norm2 = norm(cout)
        self.conv2 = conv(cout, cout)
        if cin != cout:
            self.nin_shortcut = nn.Conv2d(cin, cout, 1)

    def forward(self, x, *cond):
        h = self.conv1(F.silu(self.norm1(x, *cond)))
        h = self.conv2(F.silu(self.norm2(h, *cond)))
        if hasattr(self, "nin_shortcut"):
            x = self.nin_shortcut(x)
        return x + h


class AttnBlock(nn.Module):
    """Single-head attention over spatial positions."""

    def __init__(self, channels: int, norm=group_norm):
        super().__init__()
        self.norm = norm(channels)
        self.q, self.k, self.v = (nn.Conv2d(channels, channels, 1) for _ in range(3))
        self.proj_out = nn.Conv2d(channels, channels, 1)

    def forward(self, x, *cond):
        b, c, h, w = x.shape
        n = self.norm(x, *cond)
        q, k, v = (proj(n).reshape(b, c, h * w).transpose(1, 2) for proj in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v)
        return x + self.proj_out(out.transpose(1, 2).reshape(b, c, h, w))


class Upsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Downsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2)

    def forward(self, x):
        return self.conv(F.pad(x, (0, 1, 0, 1)))


@dataclass
class KLConfig:
    embed_dim: int = 16
    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    num_res_blocks: int = 2
    encoder_attn_levels: tuple[int, ...] = (4,)  # KL-16 attends at its lowest resolution
    decoder_attn_levels: tuple[int, ...] = ()
    with_encoder: bool = True
    mid_attention: bool = True  # the decoder's middle attends (Infinity's BSQ VAE does not)

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

    def __init__(self, cin: int, cout: int, blocks: int, attn: bool, resample: type | None, norm=group_norm):
        super().__init__()
        self.block = nn.ModuleList(ResnetBlock(cin if i == 0 else cout, cout, norm) for i in range(blocks))
        self.attn = nn.ModuleList(AttnBlock(cout, norm) for _ in range(blocks if attn else 0))
        if resample is Downsample:
            self.downsample = Downsample(cout)
        elif resample is Upsample:
            self.upsample = Upsample(cout)

    def forward(self, x, *cond):
        for i, block in enumerate(self.block):
            x = block(x, *cond)
            if len(self.attn):
                x = self.attn[i](x, *cond)
        for name in ("downsample", "upsample"):
            if hasattr(self, name):
                x = getattr(self, name)(x)
        return x


class Middle(nn.Module):
    def __init__(self, channels: int, norm=group_norm, attention: bool = True):
        super().__init__()
        self.block_1 = ResnetBlock(channels, channels, norm)
        if attention:
            self.attn_1 = AttnBlock(channels, norm)
        self.block_2 = ResnetBlock(channels, channels, norm)

    def forward(self, x, *cond):
        x = self.block_1(x, *cond)
        if hasattr(self, "attn_1"):
            x = self.attn_1(x, *cond)
        return self.block_2(x, *cond)


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
    def __init__(self, cfg: KLConfig, norm=group_norm):
        super().__init__()
        widths = [cfg.ch * m for m in cfg.ch_mult]
        self.conv_in = nn.Conv2d(cfg.embed_dim, widths[-1], 3, padding=1)
        self.mid = Middle(widths[-1], norm, cfg.mid_attention)
        # up[i] works at level i's resolution; they run from the lowest resolution (the last) to up[0]
        self.up = nn.ModuleList(
            Level(widths[min(i + 1, len(widths) - 1)], widths[i], cfg.num_res_blocks + 1, i in cfg.decoder_attn_levels,
                  Upsample if i != 0 else None, norm) for i in range(len(widths)))
        self.norm_out = norm(widths[0])
        self.conv_out = nn.Conv2d(widths[0], 3, 3, padding=1)

    def forward(self, z, *cond):
        x = self.mid(self.conv_in(z), *cond)
        for level in reversed(self.up):
            x = level(x, *cond)
        return self.conv_out(F.silu(self.norm_out(x, *cond)))


@dataclass
class VQGANConfig:
    codebook_size: int = 8192
    embed_dim: int = 256  # code width
    z_channels: int = 256  # the decoder's latent width
    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    num_res_blocks: int = 2
    encoder_attn_levels: tuple[int, ...] = ()
    decoder_attn_levels: tuple[int, ...] = ()
    with_encoder: bool = True

    def __post_init__(self):
        for name in ("ch_mult", "encoder_attn_levels", "decoder_attn_levels"):
            setattr(self, name, tuple(getattr(self, name)))

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)

    def blocks(self) -> KLConfig:
        """The encoder/decoder layout in the KL autoencoder's terms (its latent = the VQGAN's z)."""
        return KLConfig(embed_dim=self.z_channels, ch=self.ch, ch_mult=self.ch_mult, num_res_blocks=self.num_res_blocks,
                        encoder_attn_levels=self.encoder_attn_levels, decoder_attn_levels=self.decoder_attn_levels,
                        with_encoder=self.with_encoder)

    @classmethod
    def from_state_dict(cls, sd: dict, source: str, what: str = "a VQGAN", **extra) -> "VQGANConfig":
        try:
            kl = KLConfig.from_state_dict(sd, source)  # its "embed_dim" is the decoder's latent width
            codebook = sd["quantize.embedding.weight"]
        except KeyError as e:
            raise FastARError(f"{source} looks like {what} but lacks {e.args[0]}: the file is incomplete, "
                              "re-download it") from None
        return cls(codebook_size=codebook.shape[0], embed_dim=codebook.shape[1], z_channels=kl.embed_dim, ch=kl.ch,
                   ch_mult=kl.ch_mult, num_res_blocks=kl.num_res_blocks, encoder_attn_levels=kl.encoder_attn_levels,
                   decoder_attn_levels=kl.decoder_attn_levels, with_encoder=kl.with_encoder, **extra)
