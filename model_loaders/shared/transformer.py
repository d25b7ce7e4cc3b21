"""The LLaMA-style pieces every token model's decoder shares (LlamaGen, the Chameleon and Janus decoders, the
EAGLE drafter, DD students): RMSNorm in fp32, the static per-row KV cache, and the attention mask over its slots; and
the next-scale models' cache (VAR, Infinity), filled scale by scale."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .compiled_session import cache_zeros


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


# a cache's slots past those a session uses: the slots a forward attends over are then never the whole tensor,
# whose length a compiled step would otherwise be specialised to (that length is dynamic: attended_slots)
SPARE_SLOTS = 1


class KVCache:
    """Static per-layer cache ``[R, H_kv, S, hd]``; writes go to per-row slots, so rows may advance
    independently and a rejected draft is simply overwritten by the next write."""

    def __init__(self, rows, n_kv_head, slots, head_dim, dtype, device):
        held = slots + SPARE_SLOTS
        self.k = cache_zeros(rows, n_kv_head, held, head_dim, dtype=dtype, device=device)
        self.v = cache_zeros(rows, n_kv_head, held, head_dim, dtype=dtype, device=device)
        self.row_index = torch.arange(rows, device=device)[:, None]

    def write(self, k, v, slots, keys: int):
        """Write ``k``, ``v`` at ``slots``; returns the first ``keys`` slots of each, those a forward attends (its
        mask's width)."""
        self.k[self.row_index, :, slots] = k
        self.v[self.row_index, :, slots] = v
        return self.k[:, :, :keys], self.v[:, :, :keys]

    def move(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Copy each row's slots ``source`` [R, J] to its slots ``target`` [R, J] (a draft tree's accepted path into
        the slots of its positions); every source is read before anything is written."""
        self.k[self.row_index, :, target] = self.k[self.row_index, :, source]
        self.v[self.row_index, :, target] = self.v[self.row_index, :, source]

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


KEY_LENGTHS = 8  # the key lengths a session's forwards attend over: each a CUDA graph of a compiled step


def attended_slots(slot_index: torch.Tensor, needed: int) -> torch.Tensor:
    """The cache slots a forward attends over (``slot_index`` [S] is every slot): the first ``needed`` (all a row has
    written, this forward's included), rounded up to a multiple of S / KEY_LENGTHS. The cache's unwritten slots are
    masked anyway, but reading them is not free: on a GPU attention reads the whole cache, twice what it holds on
    average over an image. Only the length matters; it is marked dynamic, so that a compiled step serves every
    length with one graph (and replays a CUDA graph of each)."""
    total = slot_index.shape[0]
    step = -(-total // KEY_LENGTHS)
    keys = slot_index[: min(total, max(-(-needed // step) * step, 2))]  # 2: a length of 1 would be specialised
    torch._dynamo.mark_dynamic(keys, 0)
    return keys


def attention_mask(query_slots: torch.Tensor, cond_valid: torch.Tensor, total_slots: int) -> torch.Tensor:
    """``[R, 1, T, S]``: causal over cache slots, padded caption slots hidden, self always visible."""
    slots = torch.arange(total_slots, device=query_slots.device)
    key_valid = torch.ones(cond_valid.shape[0], total_slots, dtype=torch.bool, device=query_slots.device)
    key_valid[:, : cond_valid.shape[1]] = cond_valid
    causal = slots[None, None, :] <= query_slots[:, :, None]
    visible = (causal & key_valid[:, None, :]) | (slots[None, None, :] == query_slots[:, :, None])
    return visible[:, None]


def tree_mask(root_slots: torch.Tensor, ancestors: torch.Tensor, key_valid: torch.Tensor, keys: int,
              node_slots: torch.Tensor | None = None) -> torch.Tensor:
    """``[R, 1, T, S]`` for T nodes of draft trees whose node a sits at ``node_slots`` [R, A] (default: slot
    ``root_slots`` [R] + a): causal up to the root's slot (padded prefix slots hidden, as ``attention_mask``), then the
    nodes ``ancestors`` [R, T, A] marks (each node's ancestors and itself)."""
    R, T, A = ancestors.shape
    mask = attention_mask(root_slots[:, None].expand(R, T), key_valid, keys)[:, 0]
    if node_slots is None:
        node_slots = root_slots[:, None] + torch.arange(A, device=root_slots.device)
    return (mask | seen_slots(node_slots, ancestors, keys))[:, None]


def seen_slots(slots: torch.Tensor, seen: torch.Tensor, keys: int) -> torch.Tensor:
    """``[R, T, keys]``: which of the slots ``slots`` [R, A] each of T queries sees (``seen`` [R, T, A])."""
    R, T, A = seen.shape
    out = torch.zeros(R, T, keys, dtype=torch.bool, device=seen.device)
    return out.scatter_(2, slots.unsqueeze(1).expand(R, T, A), seen)


def move_path(caches, root_slots: torch.Tensor, path: torch.Tensor, accepted: torch.Tensor, cfg: bool) -> None:
    """After a draft tree fed from ``root_slots`` [B] on (node m at root slot + m): the accepted ``path`` [B, D]
    (node index per depth) moves into the slots of its positions, root slot + 1 + depth, in every cache (CFG's
    rows too). Nodes past ``accepted`` [B] stay where they are."""
    if cfg:
        root_slots, path, accepted = (torch.cat([t, t]) for t in (root_slots, path, accepted))
    depth = torch.arange(1, path.shape[1] + 1, device=path.device)
    source = root_slots[:, None] + torch.where(depth <= accepted[:, None], path, depth)
    target = root_slots[:, None] + depth
    for cache in caches:
        cache.move(source, target)


def feed_mask(write_slots, visible, image_slots, prefix_valid, total_slots, layout_slots=None, layout_follows=None):
    """``[R, 1, M, S]`` for feeds at arbitrary cache slots (ZipAR): feed m sees the real prefix slots
    (``prefix_valid`` [R, P]), the image positions ``visible`` [R, M, N] allows (image position j sits at slot
    ``image_slots[j]``), and its own slot ``write_slots`` [R, M]. Layout slots (row ends, ``layout_slots`` [K]) are
    seen with the image position ``layout_follows`` [K] that comes right after them."""
    R, M, _ = visible.shape
    keys = torch.zeros(R, M, total_slots, dtype=torch.bool, device=visible.device)
    keys[:, :, : prefix_valid.shape[1]] = prefix_valid[:, None, :]
    keys[:, :, image_slots] = visible
    if layout_slots is not None:
        keys[:, :, layout_slots] = visible[:, :, layout_follows]
    keys |= torch.arange(total_slots, device=visible.device) == write_slots[..., None]
    return keys[:, None]


def sees_itself(visible, positions):
    """``[R, M]``: whether each feed's own position is one it may see (a row start's token is then the real one)."""
    return visible.gather(2, positions.unsqueeze(-1)).squeeze(-1)


class FFN(nn.Module):
    """The next-scale models' MLP (VAR's and Infinity's): tanh GELU between two biased linear layers."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class HeadNorm(nn.Module):
    """The next-scale models' ``head_nm`` (AdaLNBeforeHead): LayerNorm without affine, then ``* (1 + scale) +
    shift`` from SiLU/Linear of the condition (scale first); in fp32 whatever the weights' dtype, as the releases'
    heads run (their autocast leaves them fp32)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.ada_lin = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))

    def forward(self, h, cond):
        scale, shift = self.ada_lin(cond.to(self.ada_lin[1].weight.dtype)).float().view(-1, 1, 2, h.shape[-1]).unbind(2)
        return F.layer_norm(h.float(), (h.shape[-1],), eps=self.eps) * (1 + scale) + shift


class ScaleCache:
    """A block's keys and values for every slot of the sequence ``[rows, heads, L, head_dim]``, filled scale by scale:
    the same tensors from a generation's first scale to its last (the release grows a list instead), which is what
    a step compiled with CUDA graphs needs (compiled_session.py: reused between generations there)."""

    def __init__(self, rows: int, heads: int, slots: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.k = cache_zeros(rows, heads, slots, head_dim, dtype=dtype, device=device)
        self.v = cache_zeros(rows, heads, slots, head_dim, dtype=dtype, device=device)
        self.filled = 0  # slots written so far by forward_pruned (GrowingSlots)

    def at(self, begin: int, end: int) -> "ScaleSlots":
        return ScaleSlots(self, begin, end)


@dataclass(frozen=True)
class ScaleSlots:
    """The slots of one scale in a ScaleCache: where its keys and values go, and all a query of it attends to."""

    cache: ScaleCache
    begin: int
    end: int

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This scale's keys and values written; the keys and values of every slot up to its end."""
        self.cache.k[:, :, self.begin:self.end] = k
        self.cache.v[:, :, self.begin:self.end] = v
        return self.cache.k[:, :, :self.end], self.cache.v[:, :, :self.end]


class GrowingSlots:
    """A block's cache filled from where the last scale's tokens ended: a pruned scale writes only the keys and
    values of the tokens that ran (the release caches no others), so later scales attend to those alone. ``rows``:
    the first rows only (SkipVAR's conditional-only scales leave the unconditional rows' slots as they were)."""

    def __init__(self, cache: ScaleCache, rows: int):
        self.cache, self.rows = cache, rows

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        begin = self.cache.filled
        end = begin + k.shape[2]
        self.cache.k[: self.rows, :, begin:end] = k
        self.cache.v[: self.rows, :, begin:end] = v
        self.cache.filled = end
        return self.cache.k[: self.rows, :, :end], self.cache.v[: self.rows, :, :end]
