"""VAR (FoundationVision/VAR): next-scale prediction over the token maps of a multi-scale residual VQVAE.

Key names follow the released ``var_d{16,20,24,30}.pth`` (raw state dicts); the math, each point pinned by a test:
- the sequence is the scales' token maps in order (``patch_nums`` 1, 2, ... 16 at 256 px: 680 slots). Scale 0
  is one slot, the class embedding plus ``pos_start``; scale k > 0 reads ``word_embed`` (Linear C_vae -> dim) of
  the VQVAE's running sum f_hat area-downsampled to that scale; every slot adds ``lvl_embed`` of its scale and
  its row of ``pos_1LC``;
- blocks condition on the raw class embedding: ``ada_lin`` (SiLU, Linear dim -> 6 dim) gives gamma1, gamma2,
  scale1, scale2, shift1, shift2 in that order; ``x += attn(LN(x)(1 + scale1) + shift1) gamma1``, the same for
  the FFN (tanh GELU) with the second set; LayerNorm without affine, eps 1e-6;
- attention sees its own and earlier scales (block-causal); per head, q and k are L2-normalised and q is
  scaled by ``exp(min(scale_mul_1H11, ln 100))``, with no other scale; q and v have biases, k none;
- the head: ``head_nm`` (LN without affine, ``(1 + scale)``, ``+ shift`` from SiLU/Linear of the condition,
  scale first) then ``head`` (Linear dim -> V), in fp32.
CFG runs the unconditional rows (class ``num_classes``, the null class) after the conditional ones, fed the
same token maps.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..shared.protocol import ClassConditioning, ModelOutput, ScalePruning
from ..shared.transformer import FFN, GrowingSlots, HeadNorm, ScaleCache, ScaleSlots

MAX_SCALE_MUL = math.log(100.0)


@dataclass
class VARConfig:
    depth: int = 16
    dim: int = 1024
    n_head: int = 16
    mlp_ratio: float = 4.0
    vocab_size: int = 4096
    channels: int = 32  # the VQVAE's code width (C_vae)
    num_classes: int = 1000
    patch_nums: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8, 10, 13, 16)
    norm_eps: float = 1e-6
    class_names: tuple[str, ...] = ()
    model_type: str = "c2i"

    def __post_init__(self):
        self.patch_nums = tuple(self.patch_nums)
        self.class_names = tuple(self.class_names)

    @property
    def seq_len(self) -> int:
        return sum(p * p for p in self.patch_nums)

    @property
    def grid(self) -> tuple[int, int]:
        return (self.patch_nums[-1], self.patch_nums[-1])

    @property
    def ffn_hidden(self) -> int:
        return round(self.dim * self.mlp_ratio)

    def scale_bounds(self) -> list[tuple[int, int]]:
        """``(begin, end)`` of each scale's slots in the sequence."""
        ends = torch.tensor([p * p for p in self.patch_nums]).cumsum(0).tolist()
        return [(end - p * p, end) for p, end in zip(self.patch_nums, ends)]


def layer_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), eps=eps)


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.mat_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(dim))
        self.v_bias = nn.Parameter(torch.zeros(dim))
        self.register_buffer("zero_k_bias", torch.zeros(dim))
        self.scale_mul_1H11 = nn.Parameter(torch.full((1, heads, 1, 1), 4.0).log())  # log space
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor], cache: Optional[ScaleSlots]) -> torch.Tensor:
        B, L, C = x.shape
        bias = torch.cat([self.q_bias, self.zero_k_bias, self.v_bias])
        qkv = self.mat_qkv(x) + bias  # the layer has none of its own: VAR's q and v biases, k's zero
        q, k, v = qkv.view(B, L, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        q = F.normalize(q, dim=-1) * self.scale_mul_1H11.clamp(max=MAX_SCALE_MUL).exp()
        k = F.normalize(k, dim=-1)
        if cache is not None:  # earlier scales' keys and values, then this scale's
            k, v = cache.extend(k, v)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
        return self.proj(out.transpose(1, 2).reshape(B, L, C))


class AdaLNBlock(nn.Module):
    """``AdaLNSelfAttn`` of the release (not the shared-AdaLN variant of VAR-d36)."""

    def __init__(self, cfg: VARConfig):
        super().__init__()
        self.eps = cfg.norm_eps
        self.attn = SelfAttention(cfg.dim, cfg.n_head)
        self.ffn = FFN(cfg.dim, cfg.ffn_hidden)
        self.ada_lin = nn.Sequential(nn.SiLU(), nn.Linear(cfg.dim, 6 * cfg.dim))

    def forward(self, x, cond, mask=None, cache=None, between: Optional[torch.Tensor] = None):
        """``between`` is added after the attention's residual and before the FFN's (VAR-DD's layer-wise
        data/noise embedding)."""
        gamma1, gamma2, scale1, scale2, shift1, shift2 = self.ada_lin(cond).view(-1, 1, 6, x.shape[-1]).unbind(2)
        x = x + self.attn(layer_norm(x, self.eps) * (1 + scale1) + shift1, mask, cache) * gamma1
        if between is not None:
            x = x + between
        return x + self.ffn(layer_norm(x, self.eps) * (1 + scale2) + shift2) * gamma2

    def forward_pruned(self, x, cond, cache: GrowingSlots, pruning: ScalePruning, index: int):
        """``forward`` with each sub-layer on the tokens ``pruning`` keeps (FastVAR; chosen from the residual
        before the norm, as the release does), the rest restored by it."""
        gamma1, gamma2, scale1, scale2, shift1, shift2 = self.ada_lin(cond).view(-1, 1, 6, x.shape[-1]).unbind(2)
        kept = pruning.keep(index, "attn", x)
        h = self.attn(layer_norm(pruning.take(x, kept), self.eps) * (1 + scale1) + shift1, None, cache) * gamma1
        x = x + pruning.restore(index, "attn", h, kept)
        kept = pruning.keep(index, "ffn", x)
        h = self.ffn(layer_norm(pruning.take(x, kept), self.eps) * (1 + scale2) + shift2) * gamma2
        return x + pruning.restore(index, "ffn", h, kept)


def level_ids(patch_nums) -> torch.Tensor:
    """``[L]``: each slot's scale index."""
    return torch.cat([torch.full((p * p,), i) for i, p in enumerate(patch_nums)])


def block_causal_mask(patch_nums) -> torch.Tensor:
    """``[L, L]`` bool: slot i sees slot j iff j's scale is not later than i's."""
    levels = level_ids(patch_nums)
    return levels[:, None] >= levels[None, :]


def additive_mask(mask: torch.Tensor) -> torch.Tensor:
    """A bool mask ``[L, L]`` as the release stores it: an additive bias ``[1, 1, L, L]`` (0 or -inf)."""
    return torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))[None, None]


class VAR(nn.Module):
    kind = "next-scale"
    what = "a VAR model (next-scale prediction)"
    decoder_kind = "multi-scale"  # its image decoder: the multi-scale VQVAE

    def __init__(self, cfg: VARConfig):
        super().__init__()
        self.cfg = cfg
        C, L, S = cfg.dim, cfg.seq_len, len(cfg.patch_nums)
        self.word_embed = nn.Linear(cfg.channels, C)
        self.class_emb = nn.Embedding(cfg.num_classes + 1, C)  # the last row is the null class
        self.pos_start = nn.Parameter(torch.zeros(1, 1, C))
        self.pos_1LC = nn.Parameter(torch.zeros(1, L, C))
        self.lvl_embed = nn.Embedding(S, C)
        self.register_buffer("lvl_1L", level_ids(cfg.patch_nums).view(1, L))
        self.register_buffer("attn_bias_for_masking", additive_mask(block_causal_mask(cfg.patch_nums)))
        self.blocks = nn.ModuleList(AdaLNBlock(cfg) for _ in range(cfg.depth))
        self.head_nm = HeadNorm(C, cfg.norm_eps)
        self.head = nn.Linear(C, cfg.vocab_size)

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def grid(self) -> tuple[int, int]:
        return self.cfg.grid

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.head.weight.dtype

    def decoder_input(self, latents: torch.Tensor) -> torch.Tensor:
        """The sampler's output is already the VQVAE decoder's input (f_hat ``[B, C_vae, h, w]``)."""
        return latents

    def level_positions(self) -> torch.Tensor:
        """``lvl_embed`` of each slot's scale plus ``pos_1LC``: ``[1, L, dim]``."""
        return self.lvl_embed(self.lvl_1L) + self.pos_1LC

    def logits(self, h: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        return self.head(self.head_nm(h, cond).to(self.dtype)).float()

    def forward(self, labels: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """Teacher forcing (training): ``inputs`` [B, L - 1, C_vae] are the next inputs of scales 1.. (f_hat so
        far, area-downsampled); logits ``[B, L, V]`` of every scale's tokens, fp32."""
        cond = self.class_emb(labels)
        x = torch.cat([cond[:, None] + self.pos_start, self.word_embed(inputs.to(self.dtype))], dim=1)
        x = x + self.level_positions()
        mask = self.attn_bias_for_masking[0, 0] == 0
        for block in self.blocks:
            x = block(x, cond, mask)
        return self.logits(x, cond)

    def start(self, conditioning: ClassConditioning, *, cfg: bool) -> "VARSession":
        return VARSession(self, conditioning.labels.to(self.device), cfg)


class VARSession:
    """One generation: scales are fed in order, each attending to the cached keys and values of the earlier
    ones (the release's KV cache; equal to the block-causal mask)."""

    def __init__(self, model: VAR, labels: torch.Tensor, cfg: bool):
        self.model, self.batch = model, labels.shape[0]
        rows = torch.cat([labels, torch.full_like(labels, model.cfg.num_classes)]) if cfg else labels
        self.cond = model.class_emb(rows)
        self.positions = model.level_positions()
        self.bounds = model.cfg.scale_bounds()
        heads = model.cfg.n_head
        self.caches = [ScaleCache(rows.shape[0], heads, model.cfg.seq_len, model.cfg.dim // heads, model.dtype,
                                  model.device) for _ in model.blocks]

    @torch.no_grad()
    def forward(self, scale: int, inputs: Optional[torch.Tensor] = None) -> ModelOutput:
        """Logits of scale ``scale``'s tokens ``[B, pn^2, V]`` (cond, and uncond under CFG); ``inputs``
        [B, pn^2, C_vae] is the scale's input (None for scale 0, which reads the class)."""
        model = self.model
        begin, end = self.bounds[scale]
        if scale == 0:
            x = self.cond[:, None] + model.pos_start
        else:
            x = model.word_embed(inputs.to(model.device, model.dtype))
            x = x.repeat(self.cond.shape[0] // x.shape[0], 1, 1)
        x = x + self.positions[:, begin:end]
        for block, cache in zip(model.blocks, self.caches):
            x = block(x, self.cond, None, cache.at(begin, end))
        logits = model.logits(x, self.cond)
        if logits.shape[0] == self.batch:
            return ModelOutput(logits)
        return ModelOutput(logits[: self.batch], logits[self.batch :])

    @torch.no_grad()
    def forward_pruned(self, scale: int, inputs: Optional[torch.Tensor], pruning: ScalePruning, *,
                       cond_only: bool = False) -> ModelOutput:
        """``forward`` through ``pruning`` (NextScaleSession in shared/protocol.py): a session that takes this
        path takes it from its first scale on, since its caches then fill token by token, not slot by slot."""
        model = self.model
        begin, end = self.bounds[scale]
        rows = self.batch if cond_only else self.cond.shape[0]
        cond = self.cond[:rows]
        if scale == 0:
            x = cond[:, None] + model.pos_start
        else:
            x = model.word_embed(inputs.to(model.device, model.dtype))
            x = x.repeat(rows // x.shape[0], 1, 1)
        x = x + self.positions[:, begin:end]
        for index, (block, cache) in enumerate(zip(model.blocks, self.caches)):
            x = block.forward_pruned(x, cond, GrowingSlots(cache, rows), pruning, index)
        logits = model.logits(x, cond)
        if rows == self.batch:
            return ModelOutput(logits)
        return ModelOutput(logits[: self.batch], logits[self.batch :])
