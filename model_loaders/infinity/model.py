"""Infinity (FoundationVision/Infinity): bitwise next-scale text-to-image over the scales of a BSQ VAE.

Key names follow the released ``infinity_2b_reg.pth`` and the 8B's shards (blocks renamed from ``block_chunks``
by the loader); the math, each point pinned by a test or the conformance fixture:
- text: FLAN-T5 features of each prompt's real tokens, ``text_norm`` (RMSNorm, fp32), then ``text_proj_for_sos``
  (one learned query attending over the tokens: the start token and the AdaLN condition) and ``text_proj_for_ca``
  (Linear, tanh GELU, Linear: every block's cross-attention keys and values). CFG's unconditional rows are the
  learned ``cfg_uncond[:n]`` for a prompt of n tokens, through the same norm and projections;
- scale 0 is the condition plus ``pos_start``; scale k > 0 reads ``word_embed`` of the VAE's running sum
  interpolated to that scale (the 8B: folded 2 x 2 into 4d channels); ``lvl_embed`` of the scale is added before
  the first block only;
- blocks: shared AdaLN (``shared_ada_lin`` of the condition plus each block's ``ada_gss``: gamma1, gamma2, scale1,
  scale2, shift1, shift2), LayerNorm without affine, eps 1e-6; self-attention over this and earlier scales with q
  and k L2-normalised, q scaled by ``exp(min(scale_mul_1H11, ln 100))`` and no other scale, then 2-D RoPE; then
  ``x += cross_attn(ca_norm(x))`` (affine LayerNorm, softmax scale 1/sqrt(head_dim), padding masked); then the
  tanh-GELU FFN. The residual stream stays fp32, as the release keeps it;
- RoPE: head channels in adjacent pairs, the first half of the pairs turned by the row, the second by the column;
  a scale of h x w tokens takes rows ``round(i * H / h)`` and columns ``round(j * W / w)`` of the template's 1M
  grid H x W (``rope2d_normalized_by_hw`` 2);
- the head: ``head_nm`` (LN, ``* (1 + scale) + shift``) then ``head``: two logits per bit, (bit = 0, bit = 1)
  interleaved, so a scale's output is ``[B, h*w*bits, 2]``, a two-way choice per bit, bit 0 the most significant.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import FastARError
from ..shared.protocol import CaptionConditioning, ModelOutput, ScalePruning
from ..shared.transformer import FFN, GrowingSlots, HeadNorm, ScaleCache, ScaleSlots
from .schedules import PIXELS_PER_TOKEN
from .vae import check_image_decoder, release_name

MAX_SCALE_MUL = math.log(100.0)
ROPE_BASE = 10000.0


@dataclass
class InfinityConfig:
    depth: int = 32
    dim: int = 2048
    n_head: int = 16
    ffn_hidden: int = 8192
    text_channels: int = 2048  # FLAN-T5-XL's width
    pool_heads: int = 16  # text_proj_for_sos's heads (the release ties them to the widths)
    bits: int = 32  # bits per transformer token: the VAE's codebook_dim, times 4 where patches are folded 2 x 2
    patchify: bool = False  # the 8B: each token is a 2 x 2 patch of the VAE's grid
    text_tokens: int = 512  # cfg_uncond's rows: the longest caption
    levels: int = 15  # lvl_embed's rows
    norm_eps: float = 1e-6
    scales: tuple = ((1, 1),)  # each scale's (h, w) tokens
    rope_grid: tuple = (1, 1)  # the template's 1M grid, which RoPE positions are measured against

    def __post_init__(self):
        self.scales = tuple(tuple(s) for s in self.scales)
        self.rope_grid = tuple(self.rope_grid)

    @property
    def seq_len(self) -> int:
        return sum(h * w for h, w in self.scales)

    def scale_bounds(self) -> list[tuple[int, int]]:
        ends = torch.tensor([h * w for h, w in self.scales]).cumsum(0).tolist()
        return [(end - h * w, end) for (h, w), end in zip(self.scales, ends)]


def layer_norm(x: torch.Tensor, eps: float, norm: Optional[nn.LayerNorm] = None) -> torch.Tensor:
    """In fp32 (``norm``: an affine LayerNorm's weights)."""
    weight, bias = (norm.weight.float(), norm.bias.float()) if norm is not None else (None, None)
    return F.layer_norm(x.float(), (x.shape[-1],), weight, bias, eps)


class RMSNorm(nn.Module):
    """``text_norm``: computed in fp32, returned in the input's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        f = x.float()
        return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


def rope_angles(cfg: InfinityConfig, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[L, head_dim / 2]`` of every slot's RoPE pairs, fp32."""
    quarter = head_dim // 4
    inv_freq = 1.0 / ROPE_BASE ** (torch.arange(0, 2 * quarter, 2, dtype=torch.int64).float() / (2 * quarter))
    top_h, top_w = cfg.rope_grid
    rows, cols = [], []
    for h, w in cfg.scales:  # computed as the release computes them (fp32 products, rounded half to even)
        rows.append((torch.arange(h) * (top_h / h)).round().int().view(h, 1).expand(h, w).reshape(-1))
        cols.append((torch.arange(w) * (top_w / w)).round().int().view(1, w).expand(h, w).reshape(-1))
    rows, cols = torch.cat(rows).float(), torch.cat(cols).float()
    angles = torch.cat([torch.outer(rows, inv_freq), torch.outer(cols, inv_freq)], -1)
    return angles.cos().to(device), angles.sin().to(device)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on adjacent channel pairs of ``x`` [B, H, L, D] (fp32), by ``cos``/``sin`` [L, D/2]."""
    a, b = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.mat_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(dim))
        self.v_bias = nn.Parameter(torch.zeros(dim))
        self.scale_mul_1H11 = nn.Parameter(torch.full((1, heads, 1, 1), 4.0).log())  # log space
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, cos, sin, slots: ScaleSlots):
        B, L, C = x.shape
        # the layers are called, never their weights read: streamed and 8-bit layers hold them otherwise
        qkv = self.mat_qkv(x) + torch.cat([self.q_bias, torch.zeros_like(self.q_bias), self.v_bias])
        q, k, v = qkv.view(B, L, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        q = F.normalize(q.float(), dim=-1) * self.scale_mul_1H11.float().clamp(max=MAX_SCALE_MUL).exp()
        k = F.normalize(k.float(), dim=-1)
        q, k = rotate(q, cos, sin).to(v.dtype), rotate(k, cos, sin).to(v.dtype)
        k, v = slots.extend(k, v)
        out = F.scaled_dot_product_attention(q, k, v, scale=1.0)
        return self.proj(out.transpose(1, 2).reshape(B, L, C))


class CrossAttention(nn.Module):
    """Queries from the image tokens (``mat_q``, with bias) or, for the attentive pool, one learned query per head
    (``mat_q`` [1, heads, head_dim]); keys and values from the text (``mat_kv``, v biased; the release's
    ``zero_k_bias`` buffers are zeros, left out here as in SelfAttention)."""

    def __init__(self, dim: int, kv_dim: int, heads: int, pool: bool = False):
        super().__init__()
        self.heads = heads
        self.mat_q = nn.Parameter(torch.zeros(1, heads, dim // heads)) if pool else nn.Linear(dim, dim)
        self.mat_kv = nn.Linear(kv_dim, 2 * dim, bias=False)
        self.v_bias = nn.Parameter(torch.zeros(dim))
        self.proj = nn.Linear(dim, dim)

    def keys_values(self, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[R, heads, T, head_dim]`` each, from text ``[R, T, kv_dim]``."""
        kv = self.mat_kv(text) + torch.cat([torch.zeros_like(self.v_bias), self.v_bias])
        k, v = kv.view(*text.shape[:2], 2, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        return k, v

    def forward(self, x: Optional[torch.Tensor], kv, mask: torch.Tensor) -> torch.Tensor:
        """``x`` [R, L, dim] (None: the pool's learned query); ``mask`` [R, T], True at real text tokens."""
        k, v = kv
        if x is None:
            q = self.mat_q.to(v.dtype).unsqueeze(2).expand(v.shape[0], -1, -1, -1)
        else:
            q = self.mat_q(x).view(*x.shape[:2], self.heads, -1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None])
        return self.proj(out.transpose(1, 2).flatten(2))


class Block(nn.Module):
    """``CrossAttnBlock`` of the release, with shared AdaLN."""

    def __init__(self, cfg: InfinityConfig):
        super().__init__()
        self.eps = cfg.norm_eps
        self.ada_gss = nn.Parameter(torch.zeros(1, 1, 6, cfg.dim))
        self.sa = SelfAttention(cfg.dim, cfg.n_head)
        self.ca = CrossAttention(cfg.dim, cfg.dim, cfg.n_head)
        self.ca_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.ffn = FFN(cfg.dim, cfg.ffn_hidden)

    def forward(self, x, gss, text, mask, cos, sin, slots, pruning: Optional[ScalePruning] = None, index: int = 0):
        """``x`` [R, L, dim] fp32 (the residual stream); ``gss`` [R, 1, 6, dim] fp32; ``text`` this block's
        cross-attention keys and values. ``pruning`` (FastVAR, block ``index``): each sub-layer (self-attention,
        cross-attention, FFN) on the tokens it keeps, chosen from the residual before the norm as the release
        does, RoPE turned by the kept tokens' own positions; the rest restored by it."""
        pruning = pruning or EVERY_TOKEN
        dtype = self.ada_gss.dtype  # the weights' (a layer's own may be 8-bit codes)
        gamma1, gamma2, scale1, scale2, shift1, shift2 = (self.ada_gss.float() + gss).unbind(2)
        kept = pruning.keep(index, "attn", x)
        if kept is not None:  # [R, 1, k, head_dim / 2]: each row's kept tokens' angles
            cos, sin = cos[kept][:, None], sin[kept][:, None]
        attn_in = layer_norm(pruning.take(x, kept), self.eps) * (1 + scale1) + shift1
        h = self.sa(attn_in.to(dtype), cos, sin, slots).float() * gamma1
        x = x + pruning.restore(index, "attn", h, kept)
        kept = pruning.keep(index, "cross", x)
        h = self.ca(layer_norm(pruning.take(x, kept), self.eps, self.ca_norm).to(dtype), text, mask).float()
        x = x + pruning.restore(index, "cross", h, kept)
        kept = pruning.keep(index, "ffn", x)
        ffn_in = layer_norm(pruning.take(x, kept), self.eps) * (1 + scale2) + shift2
        return x + pruning.restore(index, "ffn", self.ffn(ffn_in.to(dtype)).float() * gamma2, kept)


class EveryToken:
    """A ScalePruning that keeps every token (the plain forward)."""

    def keep(self, block, name, x):
        return None

    def take(self, x, kept):
        return x

    def restore(self, block, name, out, kept):
        return out


EVERY_TOKEN = EveryToken()


class Infinity(nn.Module):
    kind = "next-scale"
    what = "an Infinity model (bitwise next-scale text-to-image)"
    decoder_kind = "multi-scale-bits"  # its image decoder: the BSQ VAE (vae.py)
    conditioning_kind = "caption"
    caption_padding = "right"  # each caption's real tokens first (llamagen/t5.py encode_verbatim)
    caption_tokens = 512  # the release tokenises prompts up to 512 tokens
    guidance = "constant"  # the release's cfg_list is one value for every scale
    vocab_size = 2  # each bit is a two-way choice

    def __init__(self, cfg: InfinityConfig):
        super().__init__()
        self.cfg = cfg
        C, Ct5 = cfg.dim, cfg.text_channels
        self.cfg_uncond = nn.Parameter(torch.zeros(cfg.text_tokens, Ct5))
        self.text_norm = RMSNorm(Ct5, cfg.norm_eps)
        self.text_proj_for_sos = nn.Module()
        self.text_proj_for_sos.ca = CrossAttention(C, Ct5, cfg.pool_heads, pool=True)
        self.text_proj_for_ca = nn.Sequential(nn.Linear(Ct5, C), nn.GELU(approximate="tanh"), nn.Linear(C, C))
        self.pos_start = nn.Parameter(torch.zeros(1, 1, C))
        self.lvl_embed = nn.Embedding(cfg.levels, C)
        self.word_embed = nn.Linear(cfg.bits, C)
        self.shared_ada_lin = nn.Sequential(nn.SiLU(), nn.Linear(C, 6 * C))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.head_nm = HeadNorm(C, cfg.norm_eps)
        self.head = nn.Linear(C, 2 * cfg.bits)

    @property
    def release_defaults(self) -> dict:
        """The release's sampling: cfg 3 and tau 0.5 in its 2B notebook and predict.py (scripts/infer.sh runs cfg 4),
        tau 1.0 in its 8B notebooks; top-k 900, top-p 0.97 (gen_one_img's)."""
        return {"cfg": 3.0, "temperature": 1.0 if self.cfg.patchify else 0.5, "top_k": 900, "top_p": 0.97}

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.head.weight.dtype

    @property
    def scale_shapes(self) -> tuple:
        return self.cfg.scales

    @property
    def grid(self) -> tuple[int, int]:
        return self.cfg.scales[-1]

    @property
    def codes_per_slot(self) -> int:
        return self.cfg.bits

    @property
    def vae_bits(self) -> int:
        """The VAE's codebook_dim."""
        return self.cfg.bits // 4 if self.cfg.patchify else self.cfg.bits

    def vae_shapes(self) -> list[tuple[int, int]]:
        """Each scale's grid at the VAE's resolution."""
        fold = 2 if self.cfg.patchify else 1
        return [(h * fold, w * fold) for h, w in self.cfg.scales]

    @property
    def f_hat_shape(self) -> tuple[int, int, int]:
        return (self.vae_bits, *self.vae_shapes()[-1])

    def decoder_input(self, latents: torch.Tensor) -> torch.Tensor:
        """The sampler's output is the VAE decoder's input (f_hat)."""
        return latents

    def check_image_decoder(self, vae) -> None:
        """``vae`` must be the BSQ VAE the model was trained with: its bits per cell, 16 px per token."""
        cell = PIXELS_PER_TOKEN // (2 if self.cfg.patchify else 1)
        if vae is None:
            raise FastARError(f"{self.what} needs its BSQ VAE as the image decoder "
                              f"({release_name(self.vae_bits, cell)}): each scale's bits become the next scale's input "
                              "through it. Give it with --vq")
        check_image_decoder(vae, self.vae_bits, cell, self.what)

    def to_vae_grid(self, bits: torch.Tensor) -> torch.Tensor:
        """A scale's bits ``[B, h, w, bits]`` at the VAE's grid: the 8B's 2 x 2 patches unfolded (pixel_shuffle)."""
        if not self.cfg.patchify:
            return bits
        return F.pixel_shuffle(bits.permute(0, 3, 1, 2), 2).permute(0, 2, 3, 1)

    def next_input(self, vae, f_hat: torch.Tensor, bits: torch.Tensor, scale: int):
        """The VAE's running sum with scale ``scale``'s bits ``[B, h, w, bits]`` added, and the next scale's input
        ``[B, h'*w', bits]`` (None after the last scale)."""
        bits = self.to_vae_grid(bits).to(vae.device)
        f_hat, inputs = vae.next_input(f_hat.to(vae.device), bits, scale, self.vae_shapes())
        if inputs is None:
            return f_hat, None
        if self.cfg.patchify:
            inputs = F.pixel_unshuffle(inputs, 2)
        return f_hat, inputs.flatten(2).transpose(1, 2)

    def start(self, conditioning: CaptionConditioning, *, cfg: bool) -> "InfinitySession":
        return InfinitySession(self, conditioning, cfg)


def caption_rows(model: Infinity, conditioning: CaptionConditioning, cfg: bool):
    """The text rows (cond, then under CFG ``cfg_uncond[:n]`` for each prompt of n tokens) and their mask."""
    if not isinstance(conditioning, CaptionConditioning):
        raise FastARError(f"{model.what} is conditioned on FLAN-T5 features of a prompt: give --prompt and --t5")
    text = conditioning.embeddings.to(model.device, model.dtype)
    mask = conditioning.mask.to(model.device, torch.bool)
    T = text.shape[1]
    if text.dim() != 3 or text.shape[2] != model.cfg.text_channels or tuple(mask.shape) != tuple(text.shape[:2]):
        raise FastARError(f"caption features of shape {tuple(text.shape)} with a mask of {tuple(mask.shape)}: "
                          f"{model.what} reads [B, T, {model.cfg.text_channels}] (FLAN-T5-XL's) with a [B, T] mask")
    if T > model.cfg.text_tokens:
        raise FastARError(f"captions of {T} tokens: {model.what} reads at most {model.cfg.text_tokens}")
    if not mask[:, 0].all() or (mask[:, 1:] & ~mask[:, :-1]).any():
        raise FastARError(f"{model.what} reads each caption's real tokens first (right padding) and at least one")
    if cfg:
        uncond = model.cfg_uncond[:T].to(text.dtype).expand_as(text) * mask[..., None]
        text, mask = torch.cat([text, uncond]), torch.cat([mask, mask])
    return text, mask


class InfinitySession:
    """One generation: the text encoded once (each block's cross-attention keys and values too), then scales fed in
    order, each attending to the cached keys and values of the earlier ones (the release's KV cache)."""

    def __init__(self, model: Infinity, conditioning: CaptionConditioning, cfg: bool):
        self.model, self.batch = model, conditioning.batch
        with torch.no_grad():
            text, self.mask = caption_rows(model, conditioning, cfg)
            text = model.text_norm(text)
            pool = model.text_proj_for_sos.ca
            self.cond = pool(None, pool.keys_values(text), self.mask)[:, 0]  # [R, dim]
            projected = model.text_proj_for_ca(text)
            self.text = [block.ca.keys_values(projected) for block in model.blocks]
            self.gss = model.shared_ada_lin(self.cond).float().view(-1, 1, 6, model.cfg.dim)
        rows, heads = text.shape[0], model.cfg.n_head
        head_dim = model.cfg.dim // heads
        self.cos, self.sin = rope_angles(model.cfg, head_dim, model.device)
        self.bounds = model.cfg.scale_bounds()
        self.caches = [ScaleCache(rows, heads, model.cfg.seq_len, head_dim, model.dtype, model.device)
                       for _ in model.blocks]

    @torch.no_grad()
    def forward(self, scale: int, inputs: Optional[torch.Tensor] = None) -> ModelOutput:
        """Bit logits of scale ``scale`` ``[B, h*w*bits, 2]`` (cond, and uncond under CFG); ``inputs``
        [B, h*w, bits] is the scale's input (None for scale 0, which reads the text)."""
        begin, end = self.bounds[scale]
        return self.run(scale, inputs, self.cond.shape[0], lambda cache: cache.at(begin, end), None)

    @torch.no_grad()
    def forward_pruned(self, scale: int, inputs: Optional[torch.Tensor], pruning: ScalePruning, *,
                       cond_only: bool = False) -> ModelOutput:
        """``forward`` through ``pruning`` (NextScaleSession in shared/protocol.py): a session that takes this path
        takes it from its first scale on, since its caches then fill token by token, not slot by slot."""
        rows = self.batch if cond_only else self.cond.shape[0]
        return self.run(scale, inputs, rows, lambda cache: GrowingSlots(cache, rows), pruning)

    def run(self, scale: int, inputs, rows: int, slots, pruning) -> ModelOutput:
        """A scale's forward over the first ``rows`` rows, each block's cache seen through ``slots(cache)``."""
        model = self.model
        begin, end = self.bounds[scale]
        cond = self.cond[:rows]
        if scale == 0:
            x = (cond.float() + model.pos_start.float().view(1, -1))[:, None]
        else:
            x = model.word_embed(inputs.to(model.device, model.dtype)).float()
            x = x.repeat(rows // x.shape[0], 1, 1)
        x = x + model.lvl_embed.weight[scale].float()  # before the first block only
        cos, sin = self.cos[begin:end], self.sin[begin:end]
        gss, mask = self.gss[:rows], self.mask[:rows]
        for index, (block, text, cache) in enumerate(zip(model.blocks, self.text, self.caches)):
            text = tuple(t[:rows] for t in text)
            x = block(x, gss, text, mask, cos, sin, slots(cache), pruning, index)
        logits = model.head(model.head_nm(x, cond).to(model.dtype)).float()
        logits = logits.view(logits.shape[0], -1, 2)
        if rows == self.batch:
            return ModelOutput(logits)
        return ModelOutput(logits[: self.batch], logits[self.batch:])
