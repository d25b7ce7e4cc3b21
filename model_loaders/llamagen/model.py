"""LlamaGen GPT (c2i and t2i), faithful to the official math, with a static KV cache.

Key names follow the official checkpoints (``layers.{i}.attention.wqkv.weight`` ...), but for the feed-forward's
``w1`` and ``w3``, which run as one layer (``w13``, filled from both as a checkpoint loads: joined.py). The math that
matters for compatibility, each pinned by a test:
- RMSNorm in fp32, eps 1e-5; fused ``wqkv`` split q|k|v on dim 0; GQA heads grouped consecutively.
- 2-D RoPE, base 10000, interleaved (real, imag) channel pairs: the first half of the pairs rotates by
  the row index, the second half by the column index. Conditioning positions use an all-zero table,
  so their queries and keys are zero.
- t2i: padded caption positions are hidden from every query, but each position always sees itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..shared.protocol import CaptionConditioning, ClassConditioning, ModelOutput
from ..shared.compiled_session import padded_slots
from ..shared.transformer import (KVCache, move_path, RMSNorm, attended_slots, attention_mask, feed_mask, sees_itself,
                                  tree_mask)


def find_multiple(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - (n % k)


@dataclass
class LlamaGenConfig:
    dim: int
    n_layer: int
    n_head: int
    vocab_size: int
    grid: tuple[int, int]
    model_type: str = "c2i"  # "c2i" or "t2i"
    n_kv_head: int | None = None
    ffn_hidden: int | None = None
    num_classes: int = 1000  # c2i
    caption_dim: int = 2048  # t2i
    cls_token_num: int = 1
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    class_names: list[str] = field(default_factory=list)
    downsample: int = 16  # pixels per token side (LlamaGen's VQ-16), to turn image sizes into grids

    def __post_init__(self):
        self.grid = tuple(self.grid)
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.ffn_hidden is None:
            self.ffn_hidden = find_multiple(int(2 * 4 * self.dim / 3), 256)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    @property
    def num_tokens(self) -> int:
        return self.grid[0] * self.grid[1]


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w13 = nn.Linear(dim, 2 * hidden, bias=False)  # the releases' w1 (gate) and w3 (up): one matmul
        self.joined = {"w13": (("w1", hidden), ("w3", hidden))}  # joined.py
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved channel pairs. ``x`` [B, T, H, hd]; ``table`` [B, T, hd/2, 2] (cos, sin)."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    cos, sin = table[:, :, None, :, 0], table[:, :, None, :, 1]
    real, imag = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([real * cos - imag * sin, imag * cos + real * sin], dim=-1)
    return rotated.flatten(3).type_as(x)


def rope_2d_table(grid: tuple[int, int], head_dim: int, cond_len: int, extra: int, base: float) -> torch.Tensor:
    """``[cond_len + h*w + extra, head_dim/2, 2]``; ``extra`` scratch positions continue the raster."""
    h, w = grid
    quarter = head_dim // 4
    inv_freq = 1.0 / (base ** (torch.arange(0, 2 * quarter, 2)[:quarter].float() / (head_dim // 2)))
    index = torch.arange(h * w + extra)
    rows, cols = index // w, index % w
    angles = torch.cat([torch.outer(rows.float(), inv_freq), torch.outer(cols.float(), inv_freq)], dim=-1)
    image = torch.stack([angles.cos(), angles.sin()], dim=-1)
    return torch.cat([torch.zeros(cond_len, head_dim // 2, 2), image])


class Attention(nn.Module):
    def __init__(self, cfg: LlamaGenConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x, rope, mask, cache=None, slots=None):
        B, T, _ = x.shape
        q_size, kv_size = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        q, k, v = self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(B, T, self.n_head, self.head_dim)
        k, v = k.view(B, T, self.n_kv_head, self.head_dim), v.view(B, T, self.n_kv_head, self.head_dim)
        return self.wo(rope_attention(q, k, v, rope, mask, cache, slots))


def rope_attention(q, k, v, rope, mask, cache=None, slots=None):
    """Rotate ``q`` [B, T, H, hd] and ``k`` [B, T, H_kv, hd], write k and v to the cache (if any) and
    attend; returns [B, T, H*hd]. Shared with the EAGLE drafter's layer."""
    B, T = q.shape[:2]
    q, k = apply_rope(q, rope), apply_rope(k, rope)
    if cache is not None:
        k, v = cache.write(k, v, slots, None if mask is None else mask.shape[-1])
    else:
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, enable_gqa=q.shape[2] != k.shape[1])
    return out.transpose(1, 2).reshape(B, T, -1)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaGenConfig):
        super().__init__()
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x, rope, mask, cache=None, slots=None):
        h = x + self.attention(self.attention_norm(x), rope, mask, cache, slots)
        return h + self.feed_forward(self.ffn_norm(h))


class LabelEmbedding(nn.Module):
    """c2i conditioning; row ``num_classes`` is the null class used by CFG."""

    def __init__(self, num_classes: int, dim: int):
        super().__init__()
        self.num_classes = num_classes
        self.embedding_table = nn.Embedding(num_classes + 1, dim)

    def forward(self, labels):
        return self.embedding_table(labels)[:, None]


class CaptionProjection(nn.Module):
    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.fc1 = nn.Linear(in_dim, dim, bias=False)
        self.fc2 = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class CaptionEmbedding(nn.Module):
    """t2i conditioning; ``uncond_embedding`` is the null caption used by CFG."""

    def __init__(self, caption_dim: int, dim: int, token_num: int):
        super().__init__()
        self.cap_proj = CaptionProjection(caption_dim, dim)
        self.register_buffer("uncond_embedding", torch.randn(token_num, caption_dim) / caption_dim**0.5)

    def forward(self, captions):
        return self.cap_proj(captions)


class LlamaGenGPT(nn.Module):
    kind = "token-ar"
    what = "a LlamaGen GPT"

    def __init__(self, cfg: LlamaGenConfig):
        super().__init__()
        if cfg.dim % cfg.n_head or cfg.n_head % cfg.n_kv_head or cfg.head_dim % 4:
            raise ValueError(f"inconsistent head layout: dim {cfg.dim}, {cfg.n_head} heads, {cfg.n_kv_head} kv heads")
        self.cfg = cfg
        if cfg.model_type == "c2i":
            self.cls_embedding = LabelEmbedding(cfg.num_classes, cfg.dim)
        else:
            self.cls_embedding = CaptionEmbedding(cfg.caption_dim, cfg.dim, cfg.cls_token_num)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    # -- protocol -----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def grid(self) -> tuple[int, int]:
        return self.cfg.grid

    def cache_slots(self, conditioning, max_window: int) -> int:
        """The KV cache length a session allocates (for memory estimates)."""
        return self.cfg.cls_token_num + self.cfg.num_tokens + max_window

    @property
    def conditioning_kind(self) -> str:
        """"class" (labels) or "caption" (T5 features of a prompt, computed outside the model)."""
        return "caption" if self.cfg.model_type == "t2i" else "class"

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.weight.dtype

    def decoder_input(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes ``[B, h*w]`` -> the VQ decoder's input ``[B, h, w]``."""
        return codes.view(-1, *self.grid)

    def code_embeddings(self) -> torch.Tensor:
        return self.tok_embeddings.weight

    @torch.no_grad()
    def start(self, conditioning, *, cfg: bool, max_window: int, hidden: bool = False) -> "LlamaGenSession":
        return LlamaGenSession(self, conditioning, cfg=cfg, max_window=max_window, hidden=hidden)

    # -- shared pieces ------------------------------------------------------------------------
    def embed_conditioning(self, conditioning, cfg: bool, drop=None):
        """Conditioning rows (cond, then uncond when ``cfg``) and which cond positions are real. Rows
        where ``drop`` [B] is true get the null condition (CFG dropout when training)."""
        if self.cfg.model_type == "c2i":
            if not isinstance(conditioning, ClassConditioning):
                raise TypeError("a class-to-image LlamaGen model needs ClassConditioning")
            labels = conditioning.labels.to(self.device)
            if drop is not None:
                labels = labels.masked_fill(drop.to(self.device), self.cfg.num_classes)
            if cfg:
                labels = torch.cat([labels, torch.full_like(labels, self.cfg.num_classes)])
            h = self.cls_embedding(labels)
            return h, torch.ones(h.shape[:2], dtype=torch.bool, device=self.device)
        if not isinstance(conditioning, CaptionConditioning):
            raise TypeError("a text-to-image LlamaGen model needs CaptionConditioning")
        mask = conditioning.mask.to(self.device).bool()
        captions = conditioning.embeddings.to(self.device, self.dtype) * mask[..., None]
        null = self.cls_embedding.uncond_embedding.to(self.dtype).expand_as(captions)
        if drop is not None:
            captions = torch.where(drop.to(self.device)[:, None, None], null, captions)
        if cfg:
            captions, mask = torch.cat([captions, null]), torch.cat([mask, mask])
        return self.cls_embedding(captions), mask

    def run_layers(self, h, rope, mask, caches=None, slots=None):
        """The final-norm hidden states: what the output head (and an EAGLE drafter) reads."""
        for i, layer in enumerate(self.layers):
            h = layer(h, rope, mask, caches[i] if caches else None, slots)
        return self.norm(h)

    def training_hidden(self, conditioning, tokens: torch.Tensor, drop=None) -> torch.Tensor:
        """Teacher-forced final-norm hidden states ``[B, C + N - 1, D]`` (no cache; for training): the
        C conditioning slots, then image tokens 0..N-2; slot ``C - 1 + p`` predicts image token p.
        Rows where ``drop`` [B] is true see the null condition."""
        cond_h, key_valid = self.embed_conditioning(conditioning, cfg=False, drop=drop)
        h = torch.cat([cond_h, self.tok_embeddings(tokens[:, :-1])], dim=1)
        C, T = cond_h.shape[1], h.shape[1]
        table = rope_2d_table(self.grid, self.cfg.head_dim, C, 0, self.cfg.rope_base).to(self.device)
        mask = attention_mask(torch.arange(T, device=self.device).expand(h.shape[0], T), key_valid, T)
        return self.run_layers(h, table[None, :T].expand(h.shape[0], -1, -1, -1), mask)

    def training_logits(self, conditioning, tokens: torch.Tensor, drop=None) -> torch.Tensor:
        """Teacher-forced logits ``[B, N, V]`` predicting ``tokens`` (no cache; for training)."""
        hidden = self.training_hidden(conditioning, tokens, drop)
        return self.output(hidden[:, -tokens.shape[1] :]).float()


class LlamaGenSession:
    """A prefilled generation; see ``TokenARSession``."""

    def __init__(self, model: LlamaGenGPT, conditioning, *, cfg: bool, max_window: int, hidden: bool = False):
        self.model, self.cfg, self.keep_hidden = model, cfg, hidden
        mc = model.cfg
        self.batch = conditioning.batch
        cond_h, self.cond_valid = model.embed_conditioning(conditioning, cfg)
        rows, self.cond_len = cond_h.shape[0], cond_h.shape[1]
        # scratch slots past the last image token absorb windows of rows that are nearly done
        self.total_slots = padded_slots(self.cond_len + mc.num_tokens + max_window)
        scratch = self.total_slots - self.cond_len - mc.num_tokens
        self.rope = rope_2d_table(mc.grid, mc.head_dim, self.cond_len, scratch, mc.rope_base).to(model.device)
        self.caches = [
            KVCache(rows, mc.n_kv_head, self.total_slots, mc.head_dim, model.dtype, model.device)
            for _ in model.layers
        ]
        self.slot_index = torch.arange(self.total_slots, device=model.device)
        slots = torch.arange(self.cond_len, device=model.device).expand(rows, -1)
        prefix = self._run(cond_h, slots)
        # every conditioning slot's hidden state, for drafters that replay the prefix (t2i EAGLE)
        self.prefix_hidden = prefix if hidden else None
        self.first = self._output(prefix[:, -1:])

    @property
    def cache_bytes(self) -> int:
        return sum(c.nbytes() for c in self.caches)

    def _output(self, hidden) -> ModelOutput:
        logits = self.model.output(hidden).float()
        kept = hidden if self.keep_hidden else None
        if self.cfg:
            return ModelOutput(cond=logits[: self.batch], uncond=logits[self.batch :], hidden=kept)
        return ModelOutput(cond=logits, hidden=kept)

    def _run(self, h, slots, keys: torch.Tensor | None = None):
        mask = attention_mask(slots, self.cond_valid, self.total_slots if keys is None else keys.shape[0])
        return self.model.run_layers(h, self.rope[slots], mask, self.caches, slots)

    def key_slots(self, horizon: int) -> torch.Tensor:
        """See ``TokenARSession.key_slots``."""
        return attended_slots(self.slot_index, self.cond_len + horizon)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, start: torch.Tensor, keys: torch.Tensor | None = None) -> ModelOutput:
        if self.cfg:
            tokens, start = torch.cat([tokens, tokens]), torch.cat([start, start])
        width = tokens.shape[1]
        slots = self.cond_len + start[:, None] + torch.arange(width, device=tokens.device)
        slots = slots.clamp(max=self.total_slots - 1)
        return self._output(self._run(self.model.tok_embeddings(tokens), slots, keys))

    @torch.no_grad()
    def forward_tree(self, tokens: torch.Tensor, start: torch.Tensor, depth: torch.Tensor, ancestors: torch.Tensor,
                     keys: torch.Tensor | None = None, first: int = 0) -> ModelOutput:
        """See ``TokenARSession.forward_tree``: node m is written at the slot of position start + m, at the RoPE
        of its own position start + depth[m]."""
        if self.cfg:
            tokens, start, depth, ancestors = (torch.cat([t, t]) for t in (tokens, start, depth, ancestors))
        root = self.cond_len + start
        slots = root[:, None] + first + torch.arange(tokens.shape[1], device=tokens.device)
        mask = tree_mask(root, ancestors, self.cond_valid, self.total_slots if keys is None else keys.shape[0])
        rope = self.rope[root[:, None] + depth[:, first:first + tokens.shape[1]]]
        hidden = self.model.run_layers(self.model.tok_embeddings(tokens), rope, mask, self.caches, slots)
        return self._output(hidden)

    def keep_path(self, start: torch.Tensor, path: torch.Tensor, accepted: torch.Tensor) -> None:
        """See ``TokenARSession.keep_path``."""
        move_path(self.caches, self.cond_len + start, path, accepted, self.cfg)

    @torch.no_grad()
    def forward_at(self, tokens: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor,
                   row_start: torch.Tensor) -> ModelOutput:
        """See ``TokenARSession.forward_at``. A row start's stand-in is written to a scratch slot: only it sees it."""
        if self.cfg:
            tokens, positions, visible, row_start = (torch.cat([t, t]) for t in (tokens, positions, visible, row_start))
        image_slots = self.cond_len + torch.arange(visible.shape[-1], device=tokens.device)
        scratch = self.total_slots - 1 - torch.arange(tokens.shape[1], device=tokens.device)
        write = torch.where(row_start & ~sees_itself(visible, positions), scratch, self.cond_len + positions)
        mask = feed_mask(write, visible, image_slots, self.cond_valid, self.total_slots)
        rope = self.rope[self.cond_len + positions]
        return self._output(self.model.run_layers(self.model.tok_embeddings(tokens), rope, mask, self.caches, write))
