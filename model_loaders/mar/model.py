"""MAR (masked autoregressive image generation with a diffusion head), faithful to the official math.

Key names follow the official checkpoints (``encoder_blocks.{i}.attn.qkv.weight``, ``diffloss.net.*``).
- Tokens are continuous: ``token_dim`` channels per position (the VAE's 16 channels, patch size 1), in
  raster order over an ``h x w`` grid, scaled by MAR's factor (0.2325) relative to the VAE latents.
- Encoder: ``z_proj`` of every token, ``buffer`` leading slots all holding the class embedding (or the
  learned ``fake_latent`` for the unconditional branch), learned position embeddings, ``z_proj_ln``, then
  only the buffer and the known tokens go through the ViT blocks (masked tokens are dropped).
- Decoder: known tokens back in place, ``mask_token`` elsewhere, learned position embeddings, ViT blocks,
  the buffer dropped, plus ``diffusion_pos_embed_learned``: one condition vector per position.
- ViT blocks as timm's: pre-LayerNorm (eps 1e-6), qkv with bias, GELU MLP. Attention is bidirectional.
- DiffLoss head (SimpleMLPAdaLN): input_proj(x) through adaLN residual blocks conditioned on
  time_embed(t) + cond_embed(z); outputs eps and the variance values (2 x token_dim).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .diffusion import SpacedDiffusion
from ..shared.protocol import ClassConditioning

LN_EPS = 1e-6
TIME_FREQUENCIES = 256  # sinusoidal timestep features of the head


@dataclass
class MARConfig:
    dim: int  # encoder width
    encoder_depth: int
    encoder_heads: int
    decoder_dim: int
    decoder_depth: int
    decoder_heads: int
    head_width: int  # diffloss_w
    head_depth: int  # diffloss_d
    token_dim: int = 16
    grid: tuple[int, int] = (16, 16)
    buffer: int = 64
    num_classes: int = 1000
    mlp_ratio: float = 4.0
    scale_factor: float = 0.2325  # tokens = VAE latents * scale_factor
    class_names: list[str] = field(default_factory=list)

    def __post_init__(self):
        self.grid = tuple(self.grid)

    @property
    def num_tokens(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def model_type(self) -> str:
        return "c2i"  # every released MAR is class-conditional


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, keys=None):
        """``keys`` [B, n] bool: the positions each row may attend to (None = all)."""
        return self.mix(*self.project(x), keys)

    def project(self, x):
        """Queries, keys and values ``[B, heads, n, head_dim]`` of ``x`` [B, n, dim]."""
        b, n, d = x.shape
        return self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)

    def mix(self, q, k, v, keys=None):
        """Attention of the queries over the keys (``keys`` [B, m] bool: those each row may see), projected."""
        mask = None if keys is None else keys[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(out.transpose(1, 2).flatten(2))


@dataclass
class Trace:
    """What one call of ``MAR.conditions`` computed on the way, for LazyMAR-style reuse (``lazy.py``)."""

    kept: torch.Tensor | None = None  # [B, n]: the slots the encoder saw (buffer, then the known tokens)
    encoder: list = field(default_factory=list)  # per encoder block: keys and values of those slots
    decoder_input: torch.Tensor | None = None  # [B, slots, decoder_dim]
    decoder: list = field(default_factory=list)  # per decoder block: keys and values of every slot


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=LN_EPS)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=LN_EPS)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x, keys=None, trace: list | None = None):
        """``trace``: receives this block's keys and values (LazyMAR-style reuse keeps them)."""
        q, k, v = self.attn.project(self.norm1(x))
        if trace is not None:
            trace.append((k, v))
        x = x + self.attn.mix(q, k, v, keys)
        return x + self.mlp(self.norm2(x))


def modulate(x, shift, scale):
    return x * (1 + scale) + shift


def timestep_features(t: torch.Tensor, dim: int = TIME_FREQUENCIES, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal features of (possibly fractional) timesteps: cosines then sines."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    angles = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


class TimestepEmbedder(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(TIME_FREQUENCIES, width), nn.SiLU(), nn.Linear(width, width))

    def forward(self, t):
        return self.mlp(timestep_features(t).to(self.mlp[0].weight.dtype))


class ResBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.in_ln = nn.LayerNorm(width, eps=LN_EPS)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.SiLU(), nn.Linear(width, width))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 3 * width))

    def forward(self, x, y, reused=None, record: list | None = None):
        """``reused``: this block's MLP output from an earlier call, in place of computing it (LazyMAR-style
        reuse); ``record`` receives the one computed."""
        shift, scale, gate = self.adaLN_modulation(y).chunk(3, dim=-1)
        h = reused if reused is not None else self.mlp(modulate(self.in_ln(x), shift, scale))
        if record is not None:
            record.append(h)
        return x + gate * h


class FinalLayer(nn.Module):
    def __init__(self, width: int, out: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(width, elementwise_affine=False, eps=LN_EPS)
        self.linear = nn.Linear(width, out)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 2 * width))

    def forward(self, x, y):
        shift, scale = self.adaLN_modulation(y).chunk(2, dim=-1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class DiffusionHead(nn.Module):
    """SimpleMLPAdaLN: (x_t, t, condition z) -> (eps, variance values), each ``[N, token_dim]``."""

    def __init__(self, token_dim: int, cond_dim: int, width: int, depth: int):
        super().__init__()
        self.token_dim = token_dim
        self.time_embed = TimestepEmbedder(width)
        self.cond_embed = nn.Linear(cond_dim, width)
        self.input_proj = nn.Linear(token_dim, width)
        self.res_blocks = nn.ModuleList(ResBlock(width) for _ in range(depth))
        self.final_layer = FinalLayer(width, 2 * token_dim)

    def forward(self, x, t, z):
        return self.denoise(x, self.time_embed(t) + self.cond_embed(z))

    def denoise(self, x, y, reused: list | None = None, record: list | None = None):
        """(eps, variance values) of x_t given each row's embedded timestep and condition ``y`` [N, width].
        ``reused``/``record``: each block's MLP output taken from an earlier call, or recorded for a later one."""
        h = self.input_proj(x)
        for index, block in enumerate(self.res_blocks):
            h = block(h, y, None if reused is None else reused[index], record)
        out = self.final_layer(h, y)
        return out[:, : self.token_dim], out[:, self.token_dim:]

    def guided(self, x, y, cfg_scale: float = 1.0, keep: "HeadCache | None" = None):
        """eps with classifier-free guidance on eps (uncond + s * (cond - uncond)), and the conditional
        branch's variance values. ``y``: the embedded timestep and condition of the N rows of ``x``, or under
        CFG of 2N rows (conditional, then unconditional): both branches see the same x_t, in one batched call.
        A reverse process embeds its conditions once and its timesteps once (they repeat every step).
        ``keep``: receives what a later ``guided_reusing`` call takes instead of computing it."""
        n = x.shape[0]
        record = None if keep is None else []
        if y.shape[0] == n:
            eps, variance = self.denoise(x, y, record=record)
            cond, gap = eps, None
        else:
            both, variance = self.denoise(torch.cat([x, x]), y, record=record)
            cond, uncond = both.chunk(2)
            gap = cond - uncond
            eps, variance = uncond + cfg_scale * gap, variance[:n]
        if keep is not None:
            keep.mlp, keep.guidance = [h[:n] for h in record], gap
        return eps, variance

    def guided_reusing(self, x, y_cond, cfg_scale, kept: "HeadCache"):
        """A cheaper, relaxed ``guided`` (LazyMAR's reuse inside the head): the conditional rows only, every
        block's MLP output as ``kept`` from the last full call, and the guidance gap (cond - uncond eps) kept too."""
        eps, variance = self.denoise(x, y_cond, reused=kept.mlp)
        if kept.guidance is not None:
            eps = eps + (cfg_scale - 1) * kept.guidance
        return eps, variance


@dataclass
class HeadCache:
    """What a full head call leaves for the reusing calls after it: each block's MLP output and the guidance
    gap, for the conditional rows."""

    mlp: list = field(default_factory=list)
    guidance: torch.Tensor | None = None


class DiffLoss(nn.Module):
    """The official module path of the head (``diffloss.net.*``)."""

    def __init__(self, cfg: MARConfig):
        super().__init__()
        self.net = DiffusionHead(cfg.token_dim, cfg.decoder_dim, cfg.head_width, cfg.head_depth)


class MAR(nn.Module):
    """Condition vectors for every position from the known tokens (the masked-AR protocol)."""

    kind = "masked-ar"
    what = "a MAR model"

    def __init__(self, cfg: MARConfig):
        super().__init__()
        self.cfg = cfg
        L, slots = cfg.num_tokens, cfg.num_tokens + cfg.buffer
        self.class_emb = nn.Embedding(cfg.num_classes, cfg.dim)
        self.fake_latent = nn.Parameter(torch.zeros(1, cfg.dim))
        self.z_proj = nn.Linear(cfg.token_dim, cfg.dim)
        self.z_proj_ln = nn.LayerNorm(cfg.dim, eps=LN_EPS)
        self.encoder_pos_embed_learned = nn.Parameter(torch.zeros(1, slots, cfg.dim))
        self.encoder_blocks = nn.ModuleList(Block(cfg.dim, cfg.encoder_heads, cfg.mlp_ratio)
                                            for _ in range(cfg.encoder_depth))
        self.encoder_norm = nn.LayerNorm(cfg.dim, eps=LN_EPS)
        self.decoder_embed = nn.Linear(cfg.dim, cfg.decoder_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, cfg.decoder_dim))
        self.decoder_pos_embed_learned = nn.Parameter(torch.zeros(1, slots, cfg.decoder_dim))
        self.decoder_blocks = nn.ModuleList(Block(cfg.decoder_dim, cfg.decoder_heads, cfg.mlp_ratio)
                                            for _ in range(cfg.decoder_depth))
        self.decoder_norm = nn.LayerNorm(cfg.decoder_dim, eps=LN_EPS)
        self.diffusion_pos_embed_learned = nn.Parameter(torch.zeros(1, L, cfg.decoder_dim))
        self.diffloss = DiffLoss(cfg)
        self._schedules: dict[int, SpacedDiffusion] = {}

    @property
    def head(self) -> DiffusionHead:
        return self.diffloss.net

    def diffusion(self, sampling_steps: int) -> SpacedDiffusion:
        """The head's reverse process respaced to ``sampling_steps`` (built once per step count)."""
        if sampling_steps not in self._schedules:
            self._schedules[sampling_steps] = SpacedDiffusion(sampling_steps)
        return self._schedules[sampling_steps]

    @property
    def device(self) -> torch.device:
        return self.fake_latent.device

    @property
    def dtype(self) -> torch.dtype:
        """The transformer's precision (the diffusion head stays fp32)."""
        return self.fake_latent.dtype

    @property
    def grid(self) -> tuple[int, int]:
        return self.cfg.grid

    def decoder_input(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tokens ``[B, L, C]`` -> the KL autoencoder's latents ``[B, C, h, w]`` (divided by the scale factor)."""
        B, L, C = tokens.shape
        return (tokens.float() / self.cfg.scale_factor).transpose(1, 2).reshape(B, C, *self.grid)

    def class_vectors(self, conditioning: ClassConditioning, uncond: bool) -> torch.Tensor:
        """``[B, dim]``: the class embeddings, or the learned unconditional vector for every row."""
        if uncond:
            return self.fake_latent.expand(conditioning.batch, -1)
        return self.class_emb(conditioning.labels.to(self.device))

    def conditions(self, tokens: torch.Tensor, known: torch.Tensor, class_vectors: torch.Tensor,
                   known_count: int | None = None, trace: Trace | None = None) -> torch.Tensor:
        """Condition vectors ``[B, L, decoder_dim]`` for every position, from ``tokens`` [B, L, C] of which
        only the ``known`` [B, L] ones are seen. ``known_count``: how many tokens every row knows, where the
        caller's schedule says they all know as many: the official path, unknown tokens dropped. None: rows
        may differ (CSpD scores several contexts in one call), and the encoder masks the unknown ones out of
        attention instead of dropping them, which gives the same vectors. Neither reads the mask back to the
        host (a sync per call on a GPU). ``trace`` (with ``known_count`` only) receives what the call computed on
        the way."""
        B, L, _ = tokens.shape
        buffer = self.cfg.buffer
        x = self.encoder_input(tokens, class_vectors)
        keep = torch.cat([torch.ones(B, buffer, dtype=torch.bool, device=known.device), known], dim=1)
        mask = self.mask_token.to(x.dtype)
        if known_count is None:
            assert trace is None, "a trace needs the known count (the dropped path)"
            x = torch.where(keep.unsqueeze(-1), self.encode(x, keep), mask)
        else:  # the kept slots in order: a stable sort puts them first
            kept = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices[:, :buffer + known_count]
            encoded = self.encode(gather_slots(x, kept), None, None if trace is None else trace.encoder)
            x = mask.expand(B, buffer + L, -1).scatter(1, kept.unsqueeze(-1).expand(-1, -1, encoded.shape[-1]), encoded)
            if trace is not None:
                trace.kept = kept
        x = x + self.decoder_pos_embed_learned
        if trace is not None:
            trace.decoder_input = x
        for block in self.decoder_blocks:
            x = block(x, trace=None if trace is None else trace.decoder)
        return self.conditions_out(x)

    def encoder_input(self, tokens: torch.Tensor, class_vectors: torch.Tensor) -> torch.Tensor:
        """``[B, slots, dim]``: the buffer slots holding the class vectors, then every token, embedded."""
        B = tokens.shape[0]
        x = self.z_proj(tokens.to(self.z_proj.weight.dtype))
        x = torch.cat([class_vectors.to(x.dtype).unsqueeze(1).expand(B, self.cfg.buffer, -1), x], dim=1)
        return self.z_proj_ln(x + self.encoder_pos_embed_learned)

    def encode(self, x: torch.Tensor, keys, trace: list | None = None) -> torch.Tensor:
        """The encoder blocks and the projection to the decoder's width."""
        for block in self.encoder_blocks:
            x = block(x, keys, trace)
        return self.encoded_out(x)

    def encoded_out(self, x: torch.Tensor) -> torch.Tensor:
        """The encoder's last hidden states projected to the decoder's width."""
        return self.decoder_embed(self.encoder_norm(x))

    def conditions_out(self, x: torch.Tensor) -> torch.Tensor:
        """The decoder's last hidden states ``[B, slots, D]`` -> condition vectors ``[B, L, D]``."""
        return self.decoder_norm(x)[:, self.cfg.buffer:] + self.diffusion_pos_embed_learned


def gather_slots(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``x`` [B, S, D] at ``slots`` [B, n]: ``[B, n, D]``."""
    return x.gather(1, slots.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
