"""The LLaMA-style pieces every token model's decoder shares (LlamaGen, the Chameleon and Janus decoders, the
EAGLE drafter, DD students): RMSNorm in fp32, the static per-row KV cache, and the attention mask over its slots."""
from __future__ import annotations

import torch
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


class KVCache:
    """Static per-layer cache ``[R, H_kv, S, hd]``; writes go to per-row slots, so rows may advance
    independently and a rejected draft is simply overwritten by the next write."""

    def __init__(self, rows, n_kv_head, slots, head_dim, dtype, device):
        self.k = cache_zeros(rows, n_kv_head, slots, head_dim, dtype=dtype, device=device)
        self.v = cache_zeros(rows, n_kv_head, slots, head_dim, dtype=dtype, device=device)
        self.row_index = torch.arange(rows, device=device)[:, None]

    def write(self, k, v, slots):
        self.k[self.row_index, :, slots] = k
        self.v[self.row_index, :, slots] = v
        return self.k, self.v

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


def attention_mask(query_slots: torch.Tensor, cond_valid: torch.Tensor, total_slots: int) -> torch.Tensor:
    """``[R, 1, T, S]``: causal over cache slots, padded caption slots hidden, self always visible."""
    slots = torch.arange(total_slots, device=query_slots.device)
    key_valid = torch.ones(cond_valid.shape[0], total_slots, dtype=torch.bool, device=query_slots.device)
    key_valid[:, : cond_valid.shape[1]] = cond_valid
    causal = slots[None, None, :] <= query_slots[:, :, None]
    visible = (causal & key_valid[:, None, :]) | (slots[None, None, :] == query_slots[:, :, None])
    return visible[:, None]
