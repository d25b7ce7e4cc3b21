"""LLaMA-family decoders behind the token-AR protocol, for models whose image tokens sit in a layout of their
own (Chameleon-family, Janus): the transformer, a static per-row KV cache, and the session that feeds the
layout's tokens itself.

The math, as transformers' LLaMA-family models compute it (pinned by tests against them):
- blocks: RMSNorm (fp32 statistics), q/k/v/o projections, SwiGLU MLP; ``swin_norm`` (Chameleon-30B)
  normalises each branch's output instead of its input;
- optional per-head QK LayerNorm before RoPE (Chameleon): statistics over each head's channels, then an affine
  stored either per head (``[heads, head_dim]``, transformers' layout) or per model-parallel shard
  (``[shards, head_dim]``, Lumina-mGPT's own classes: each shard's row serves its consecutive heads), eps 1e-5;
- 1-D RoPE with rotate_half pairs (channel i with i + head_dim/2), base ``rope_theta``.

The session: each row's prefix (its prompt and the image prefix) left-padded to a common length, then the
image region: image tokens in raster order, each row followed by the layout's row-end token when it has
one. The sampler sees image codes only; a window that crosses a row end carries the row-end token inside
it, and the successor of a row's last token is read at the row end.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .transformer import (KVCache, RMSNorm, attended_slots, attention_mask, feed_mask, move_path, sees_itself,
                          seen_slots, tree_mask)
from .compiled_session import padded_prefix_len, padded_slots
from ...errors import FastARError
from .protocol import ModelOutput

QK_NORM_EPS = 1e-5


@dataclass
class DecoderConfig:
    hidden_size: int
    n_layer: int
    n_head: int
    n_kv_head: int
    ffn_hidden: int
    vocab_size: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    qk_norm: bool = False  # Chameleon's per-head QK LayerNorm
    qk_norm_rows: tuple[int, int] | None = None  # rows of the q and k norm weights; None: one per head
    swin_norm: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_head

    @property
    def dim(self) -> int:  # LlamaGen's name for the width, which memory estimates read
        return self.hidden_size


@dataclass
class ImageLayout:
    """Where image tokens sit: a grid in raster order, each row ended by ``row_end`` (None: no row tokens);
    ``filler`` is the token fed in padding slots (any real token: their outputs are never read)."""

    grid: tuple[int, int]
    row_end: int | None
    filler: int

    @property
    def num_tokens(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def region(self) -> int:
        """Slots of one image: its tokens and its row ends."""
        return self.num_tokens + (self.grid[0] if self.row_end is not None else 0)


class HeadLayerNorm(nn.Module):
    """LayerNorm over each head's channels (Chameleon's QK norm), then an affine of ``rows`` rows: one per head,
    or one per model-parallel shard shared by that shard's consecutive heads."""

    def __init__(self, heads: int, head_dim: int, rows: int | None = None):
        super().__init__()
        self.heads = heads
        self.weight = nn.Parameter(torch.ones(rows or heads, head_dim))
        self.bias = nn.Parameter(torch.zeros(rows or heads, head_dim))

    def forward(self, x):  # [B, T, H, hd]
        x = F.layer_norm(x, x.shape[-1:], eps=QK_NORM_EPS)
        rows = self.weight.shape[0]
        if rows == self.heads:
            return x * self.weight + self.bias
        shards = x.unflatten(2, (rows, self.heads // rows))  # [B, T, rows, heads per row, hd]
        return (shards * self.weight[:, None] + self.bias[:, None]).flatten(2, 3)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[B, T, 1, head_dim]`` for integer ``positions`` [B, T] (computed in fp32, then cast)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)[:, :, None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        q_width, kv_width = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_width + 2 * kv_width, bias=False)  # q, k, v: one matmul
        self.joined = {"qkv_proj": (("q_proj", q_width), ("k_proj", kv_width), ("v_proj", kv_width))}  # joined.py
        self.o_proj = nn.Linear(q_width, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            q_rows, k_rows = cfg.qk_norm_rows or (None, None)
            self.q_norm = HeadLayerNorm(cfg.n_head, cfg.head_dim, q_rows)
            self.k_norm = HeadLayerNorm(cfg.n_kv_head, cfg.head_dim, k_rows)

    def forward(self, x, rope, mask, cache: KVCache | None = None, slots=None):
        """Attention of ``x`` [B, T, D] over the cache (after writing its keys at ``slots``), or over ``x``
        itself without a cache (training)."""
        B, T, _ = x.shape
        q, k, v = self.qkv_proj(x).split([self.n_head * self.head_dim, *[self.n_kv_head * self.head_dim] * 2], -1)
        q, k = q.reshape(B, T, self.n_head, self.head_dim), k.reshape(B, T, self.n_kv_head, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        v = v.reshape(B, T, self.n_kv_head, self.head_dim)
        cos, sin = rope
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if cache is not None:  # the slots the mask covers
            keys, values = cache.write(k, v, slots, mask.shape[-1])
        else:
            keys, values = k.transpose(1, 2), v.transpose(1, 2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask,
                                             enable_gqa=self.n_head != self.n_kv_head)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(dim, 2 * hidden, bias=False)  # gate and up: one matmul
        self.joined = {"gate_up_proj": (("gate_proj", hidden), ("up_proj", hidden))}  # joined.py
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.swin = cfg.swin_norm
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.ffn_hidden)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)

    def forward(self, x, rope, mask, cache=None, slots=None):
        if self.swin:  # norm after each branch
            h = x + self.input_layernorm(self.self_attn(x, rope, mask, cache, slots))
            return h + self.post_attention_layernorm(self.mlp(h))
        h = x + self.self_attn(self.input_layernorm(x), rope, mask, cache, slots)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    """The LLaMA-family transformer: token embeddings, blocks, final norm (HF's ``LlamaModel`` names)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.rope_theta = cfg.rope_theta
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)

    def run(self, h, rope, mask, caches, slots):
        """Final-norm hidden states of embeddings ``h`` written to ``slots`` of ``caches``."""
        for layer, cache in zip(self.layers, caches):
            h = layer(h, rope, mask, cache, slots)
        return self.norm(h)

    def teacher_forced(self, h: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden states of whole sequences ``h`` [B, T, D] without a cache (training): causal,
        left padding (``valid`` [B, T] false) hidden, positions from each row's first real token."""
        T = h.shape[1]
        positions = (valid.cumsum(1) - 1).clamp(min=0)
        mask = attention_mask(torch.arange(T, device=h.device).expand(h.shape[0], T), valid, T)
        rope = rope_tables(positions, self.layers[0].self_attn.head_dim, self.rope_theta, h.dtype)
        for layer in self.layers:
            h = layer(h, rope, mask)
        return self.norm(h)


class VocabularyImageGPT(nn.Module):
    """A LLaMA-family model whose image codes are entries of its own vocabulary (the Chameleon family, Emu3), behind
    the token-AR protocol: image codes in, logits over image codes out (the image tokens' rows of ``lm_head``, in code
    order: ``image_ids``), layout tokens fed by the session. ``cfg`` gives ``image_ids``, ``grid``, ``image_prefix``
    (what follows each row's prompt) and ``image_suffix`` (what the model writes after the image); a subclass says
    how each row's prefix is made (``prefixes``)."""

    kind = "token-ar"
    conditioning_kind = "prompt"  # it tokenises prompts with its own tokenizer

    def __init__(self, cfg, decoder_cfg: DecoderConfig, layout: ImageLayout, prompts, what: str):
        super().__init__()
        self.cfg, self.what = cfg, what
        self.prompts = prompts  # turns PromptConditioning into token ids (the model's own tokenizer)
        self.decoder_cfg, self.layout = decoder_cfg, layout
        self.model = Backbone(decoder_cfg)
        self.lm_head = nn.Linear(decoder_cfg.hidden_size, decoder_cfg.vocab_size, bias=False)
        self.register_buffer("image_ids", torch.tensor(cfg.image_ids, dtype=torch.long), persistent=False)
        self.image_rows_only = False  # lm_head keeps only the image codes' rows (keep_image_rows)

    @property
    def vocab_size(self) -> int:
        return len(self.cfg.image_ids)

    @property
    def grid(self) -> tuple[int, int]:
        return self.cfg.grid

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def backbone(self) -> Backbone:
        return self.model

    def decoder_input(self, codes: torch.Tensor) -> torch.Tensor:
        return codes.view(-1, *self.grid)

    def code_embeddings(self) -> torch.Tensor:
        return self.model.embed_tokens.weight[self.image_ids]

    def embed_images(self, codes: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(self.image_ids[codes])

    def image_sequence(self, codes: torch.Tensor) -> list[int]:
        """The vocabulary ids of one image as the model writes it: the image prefix, the rows (each ended by the
        row-end token where the layout has one), the image suffix."""
        ids = self.image_ids[codes.to(self.image_ids.device)].view(self.grid).tolist()
        ends = [self.layout.row_end] if self.layout.row_end is not None else []
        return [*self.cfg.image_prefix, *(t for row in ids for t in row + ends), *self.cfg.image_suffix]

    def image_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over image codes only (the image tokens' rows of the output head), fp32."""
        weight = self.lm_head.weight if self.image_rows_only else self.lm_head.weight[self.image_ids]
        return F.linear(hidden, weight).float()

    def keep_image_rows(self) -> None:
        """Drop the output head's text rows, once (the loaders do): only image codes are ever predicted, and
        gathering their rows at every forward copied 64 MB per step at 7B; the text rows are 0.45 GB of memory."""
        self.lm_head.weight = nn.Parameter(self.lm_head.weight[self.image_ids], requires_grad=False)
        self.image_rows_only = True

    def encoded(self, conditioning) -> list[list[int]]:
        if self.prompts is None:
            raise TypeError("this model was built without a tokenizer: start a session with start_ids")
        return self.prompts.encode(conditioning)

    def uncond_of(self, conditioning) -> dict:
        """What ``prefixes`` takes from ``conditioning`` for the unconditional rows besides the prompts (Emu3: the
        negative prompts); nothing here."""
        return {}

    @torch.no_grad()
    def start(self, conditioning, *, cfg: bool, max_window: int, hidden: bool = False) -> LayoutSession:
        return self.start_ids(self.encoded(conditioning), cfg=cfg, max_window=max_window, hidden=hidden,
                              **(self.uncond_of(conditioning) if cfg else {}))

    def start_ids(self, prompts: list[list[int]], *, cfg: bool, max_window: int, hidden: bool = False, **uncond):
        """A session for rows whose prompts are ``prompts`` (token ids, without the image prefix); ``uncond`` goes to
        ``prefixes`` (what a family's unconditional rows are made of, where the caller chooses it)."""
        return LayoutSession(self, self.prefixes(prompts, cfg, **uncond), len(prompts), cfg=cfg, max_window=max_window,
                             hidden=hidden)

    def prefixes(self, prompts: list[list[int]], cfg: bool) -> list[list[int]]:
        """Each row's tokens before its image: cond rows, then CFG's uncond rows."""
        raise NotImplementedError

    def cache_slots(self, conditioning, max_window: int) -> int:
        """The KV cache length a session for ``conditioning`` allocates (for memory estimates)."""
        prefixes = self.prefixes(self.encoded(conditioning), cfg=True, **self.uncond_of(conditioning))
        return cache_slots(self.layout, max(map(len, prefixes)), max_window)


def teacher_forced_image(model, prefixes: list[list[int]], codes: torch.Tensor):
    """Final-norm hidden states of whole images behind their prefixes, without a cache (training a drafter):
    each row's prefix left-padded as a session pads it, then the image region (codes, row ends). Returns
    (hidden [B, P + region, D], prefix ids [B, P], which prefix slots are real [B, P], each code's slot [N])."""
    layout, device = model.layout, model.device
    P = max(map(len, prefixes))
    ids = torch.tensor([[layout.filler] * (P - len(p)) + list(p) for p in prefixes], device=device)
    valid = torch.arange(P, device=device)[None] >= torch.tensor([P - len(p) for p in prefixes], device=device)[:, None]
    positions = torch.arange(layout.num_tokens, device=device)
    image_slots = P + positions + (positions // layout.grid[1] if layout.row_end is not None else 0)
    embed = model.backbone.embed_tokens
    region = embed(torch.full((len(prefixes), layout.region), layout.filler if layout.row_end is None else
                              layout.row_end, device=device))
    region = region.index_copy(1, image_slots - P, model.embed_images(codes.to(device)).to(region.dtype))
    h = torch.cat([embed(ids), region], 1)
    hidden = model.backbone.teacher_forced(h, torch.cat([valid, torch.ones_like(region[..., 0], dtype=torch.bool)], 1))
    return hidden, ids, valid, image_slots


def window_slots(layout: ImageLayout, max_window: int) -> int:
    """Sequence slots a window of ``max_window`` image tokens can take (row ends included)."""
    return max_window + (max_window // layout.grid[1] + 1 if layout.row_end is not None else 0)


def cache_slots(layout: ImageLayout, prefix_len: int, max_window: int) -> int:
    """The session's cache length: prefix, image region, scratch slots for windows past the end."""
    return prefix_len + layout.region + 2 * window_slots(layout, max_window) + 2


class LayoutSession:
    """A prefilled generation; see ``TokenARSession``. Slots: the left-padded prefix, then the image
    region (image tokens and row ends), then scratch slots for windows past the last image token.

    ``model`` provides ``backbone``, ``decoder_cfg``, ``layout``, ``embed_images(codes)`` (image codes ->
    input embeddings) and ``image_logits(hidden)`` (-> logits over image codes, fp32)."""

    def __init__(self, model, prefixes: list[list[int]], batch: int, *, cfg: bool, max_window: int,
                 hidden: bool = False):
        self.model, self.cfg, self.batch, self.keep_hidden = model, cfg, batch, hidden
        dc, layout, device = model.decoder_cfg, model.layout, model.device
        rows = len(prefixes)
        self.width = layout.grid[1]
        self.rows_ends = layout.row_end is not None
        self.prefix_len = padded_prefix_len(max(len(p) for p in prefixes))
        pad = torch.tensor([self.prefix_len - len(p) for p in prefixes], device=device)
        # positions from the first real token (RoPE is relative: this only keeps the rounding of an unpadded run)
        self.position_offset = pad
        self.window_len = window_slots(layout, max_window)
        self.total_slots = padded_slots(cache_slots(layout, self.prefix_len, max_window))
        self.valid = torch.arange(self.prefix_len, device=device)[None] >= pad[:, None]  # real prefix slots
        self.caches = [KVCache(rows, dc.n_kv_head, self.total_slots, dc.head_dim, model.dtype, device)
                       for _ in model.backbone.layers]
        self.slot_index = torch.arange(self.total_slots, device=device)
        ids = torch.tensor([[layout.filler] * (self.prefix_len - len(p)) + p for p in prefixes], device=device)
        slots = torch.arange(self.prefix_len, device=device).expand(rows, -1)
        self.prefix_ids = ids  # an EAGLE drafter replays them
        prefix = self._run(model.backbone.embed_tokens(ids), slots)
        self.prefix_hidden = prefix if hidden else None
        self.first = self._output(prefix[:, -1:])

    @property
    def cache_bytes(self) -> int:
        return sum(c.nbytes() for c in self.caches)

    def _output(self, hidden) -> ModelOutput:
        logits = self.model.image_logits(hidden)
        kept = hidden if self.keep_hidden else None
        if self.cfg:
            return ModelOutput(cond=logits[: self.batch], uncond=logits[self.batch:], hidden=kept)
        return ModelOutput(cond=logits, hidden=kept)

    def _run(self, h, slots, mask=None, rope_slots=None, keys: torch.Tensor | None = None):
        """Run ``h`` written at cache ``slots``; RoPE at ``rope_slots`` (default: the slots themselves), causal
        over ``keys`` (default: every slot) unless ``mask`` is given."""
        dc = self.model.decoder_cfg
        if mask is None:
            mask = attention_mask(slots, self.valid, self.total_slots if keys is None else keys.shape[0])
        positions = (slots if rope_slots is None else rope_slots) - self.position_offset[:, None]
        rope = rope_tables(positions, dc.head_dim, dc.rope_theta, self.model.dtype)
        return self.model.backbone.run(h, rope, mask, self.caches, slots)

    def key_slots(self, horizon: int) -> torch.Tensor:
        """See ``TokenARSession.key_slots``: positions below ``horizon`` and the row ends after them lie below the
        slot of position ``horizon``."""
        return attended_slots(self.slot_index, self.image_slot(horizon))

    def image_slot(self, positions: torch.Tensor) -> torch.Tensor:
        """The cache slot of each image position (row ends take a slot after every row)."""
        return self.prefix_len + positions + (positions // self.width if self.rows_ends else 0)

    def layout(self, start: torch.Tensor, width: int):
        """The window's sequence for each row: token ids' source, slots, and where each image token's
        successor is predicted. Returns (image index or -1 for a row end [R, T], slots [R, T], out [R, W])."""
        device = start.device
        j = torch.arange(width, device=device)
        p = start[:, None] + j  # image positions fed
        if not self.rows_ends:
            return j.expand(len(start), -1), self.prefix_len + p, j.expand(len(start), -1)
        w = self.width
        t = j + (p // w - (start // w)[:, None])  # index in the sequence: row ends before it shift it
        ends_after = (p + 1) % w == 0
        out = t + ends_after.long()  # the successor of a row's last token is predicted by the row end
        T = self.window_len
        source = torch.full((len(start), T), -2, dtype=torch.long, device=device)  # -2: padding
        source.scatter_(1, t, j.expand(len(start), -1))
        end_t = torch.where(ends_after, t + 1, torch.full_like(t, T))  # T: nothing (dropped by the slice below)
        source = torch.cat([source, torch.full_like(source[:, :1], -2)], 1).scatter(1, end_t, -1)[:, :T]
        slots = torch.full_like(source, 0)
        image_slot = self.prefix_len + p + p // w
        slots.scatter_(1, t, image_slot)
        end_slot = torch.cat([slots, slots[:, :1]], 1).scatter(1, end_t, image_slot + 1)[:, :T]
        pad_slot = self.total_slots - 1 - torch.arange(T, device=device).expand_as(source)
        slots = torch.where(source == -1, end_slot, torch.where(source == -2, pad_slot, slots))
        return source, slots, out

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, start: torch.Tensor, keys: torch.Tensor | None = None) -> ModelOutput:
        layout = self.model.layout
        if self.cfg:
            tokens, start = torch.cat([tokens, tokens]), torch.cat([start, start])
        source, slots, out = self.layout(start, tokens.shape[1])
        images = self.model.embed_images(tokens.gather(1, source.clamp(min=0)))
        others = torch.where(source == -1, layout.row_end if self.rows_ends else layout.filler, layout.filler)
        h = torch.where((source >= 0)[..., None], images, self.model.backbone.embed_tokens(others).to(images.dtype))
        hidden = self._run(h, slots.clamp(max=self.total_slots - 1), keys=keys)
        return self._output(hidden.gather(1, out[..., None].expand(-1, -1, hidden.shape[-1])))

    @torch.no_grad()
    def forward_tree(self, tokens: torch.Tensor, start: torch.Tensor, depth: torch.Tensor, ancestors: torch.Tensor,
                     keys: torch.Tensor | None = None, first: int = 0) -> ModelOutput:
        """See ``TokenARSession.forward_tree``: node m is written at the slot of image position start + m, at the
        RoPE of its own position start + depth[m]. With row ends, a node that ends a row is followed by its row's
        end token (fed with it, seen by the node's descendants, predicting the next row's first token), and the
        slots shift by one after the root to leave its own row end in place (``tree_slots``)."""
        if self.cfg:
            tokens, start, depth, ancestors = (torch.cat([t, t]) for t in (tokens, start, depth, ancestors))
        T, A = tokens.shape[1], ancestors.shape[2]
        root = self.image_slot(start)
        positions = start[:, None] + depth[:, first:first + T]
        images = self.model.embed_images(tokens)
        if not self.rows_ends:
            slots = root[:, None] + first + torch.arange(T, device=tokens.device)
            mask = tree_mask(root, ancestors, self.valid, self.total_slots if keys is None else keys.shape[0])
            return self._output(self._run(images, slots, mask, self.image_slot(positions)))
        self.tree_nodes = A  # for keep_path
        node_slots, end_slots = self.tree_slots(root, A)
        ends = (start[:, None] + depth + 1) % self.width == 0  # [R, A]: the nodes a row end follows
        own = torch.arange(A, device=tokens.device)[first:first + T, None] == torch.arange(A, device=tokens.device)
        to_nodes = tree_mask(root, ancestors, self.valid, self.total_slots, node_slots)[:, 0]
        node_mask = to_nodes | seen_slots(end_slots, ancestors & ends[:, None] & ~own, self.total_slots)
        end_mask = to_nodes | seen_slots(end_slots, ancestors & ends[:, None], self.total_slots)
        row_end = self.model.backbone.embed_tokens(torch.full_like(tokens, self.model.layout.row_end)).to(images.dtype)
        fed = slice(first, first + T)
        write = torch.cat([node_slots[:, fed], end_slots[:, fed]], 1)
        rope = torch.cat([self.image_slot(positions), self.image_slot(positions) + 1], 1)
        hidden = self._run(torch.cat([images, row_end], 1), write, torch.cat([node_mask, end_mask], 1)[:, None], rope)
        return self._output(torch.where(ends[:, fed, None], hidden[:, T:], hidden[:, :T]))

    def tree_slots(self, root: torch.Tensor, nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """With row ends, the slots [R, A] of a tree's nodes and of the row ends after them: the root at its slot
        and its row end right after it (where a chain forward, a drafter's catch-up, leaves it), node a >= 1 at
        root + 1 + a, node a's row end at root + 1 + A + a."""
        node = torch.arange(nodes, device=root.device)
        node_slots = root[:, None] + node + (node > 0).long()
        end_slots = torch.where(node > 0, root[:, None] + 1 + nodes + node, root[:, None] + 1)
        return node_slots, end_slots

    def keep_path(self, start: torch.Tensor, path: torch.Tensor, accepted: torch.Tensor) -> None:
        """See ``TokenARSession.keep_path``; with row ends, each accepted node's row end moves with it."""
        if not self.rows_ends:
            move_path(self.caches, self.image_slot(start), path, accepted, self.cfg)
            return
        if self.cfg:
            start, path, accepted = (torch.cat([t, t]) for t in (start, path, accepted))
        node_slots, end_slots = self.tree_slots(self.image_slot(start), self.tree_nodes)
        depth = torch.arange(1, path.shape[1] + 1, device=path.device)
        kept = depth <= accepted[:, None]
        target = self.image_slot(start[:, None] + depth)
        ends = kept & ((start[:, None] + depth + 1) % self.width == 0)
        scratch = torch.full_like(target, self.total_slots - 1)  # a copy onto itself: nothing moves
        source = torch.cat([torch.where(kept, node_slots.gather(1, path), scratch),
                            torch.where(ends, end_slots.gather(1, path), scratch)], 1)
        target = torch.cat([torch.where(kept, target, scratch), torch.where(ends, target + 1, scratch)], 1)
        for cache in self.caches:
            cache.move(source, target)

    @torch.no_grad()
    def forward_at(self, tokens: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor,
                   row_start: torch.Tensor) -> ModelOutput:
        """See ``TokenARSession.forward_at``. With row ends, a row start feeds the row-end token at its own slot (the
        layout's: later tokens see it, with the next row); without, the stand-in goes to a scratch slot."""
        if self.cfg:
            tokens, positions, visible, row_start = (torch.cat([t, t]) for t in (tokens, positions, visible, row_start))
        device, N = tokens.device, visible.shape[-1]
        image_slots = self.image_slot(positions)
        h = self.model.embed_images(tokens)
        if self.rows_ends:
            write = torch.where(row_start, image_slots + 1, image_slots)
            row_end = self.model.backbone.embed_tokens(torch.full_like(tokens, self.model.layout.row_end))
            h = torch.where(row_start[..., None], row_end.to(h.dtype), h)
            ends = torch.arange(self.width, N, self.width, device=device)  # the first position of every later row
            layout, rope_slots = (self.image_slot(ends) - 1, ends), write
        else:
            scratch = self.total_slots - 1 - torch.arange(tokens.shape[1], device=device)
            stand_in = row_start & ~sees_itself(visible, positions)
            write, layout, rope_slots = torch.where(stand_in, scratch, image_slots), (None, None), image_slots
        mask = feed_mask(write, visible, self.image_slot(torch.arange(N, device=device)), self.valid, self.total_slots,
                         *layout)
        return self._output(self._run(h, write, mask, rope_slots))
