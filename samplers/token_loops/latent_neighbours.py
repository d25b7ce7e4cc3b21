"""LANTERN's B_k: for every code, its k nearest codes in the VQ latent space (itself first).

Computed once per codebook (see table_cache), so each generation only gathers rows.
"""
from __future__ import annotations

import torch

from ...errors import FastARError
from .table_cache import cached_table


def latent_neighbours(codebook: torch.Tensor, k: int, chunk: int = 1024) -> torch.Tensor:
    """``[V, k]`` code indices sorted by L2 distance in ``codebook`` [V, D] (the vectors as the VQ
    decoder uses them); column 0 is the code itself even when duplicates tie with it. ``k`` is capped
    at V."""
    if k < 1:
        raise FastARError(f"LANTERN k {k} must be at least 1 (1 = no neighbours, exact speculative decoding)")
    codes = codebook.detach().float()
    V = codes.shape[0]
    k = min(int(k), V)
    return cached_table("latent_neighbours", codes, (k,), lambda c: _nearest(c, k, chunk))


def _nearest(codes: torch.Tensor, k: int, chunk: int) -> torch.Tensor:
    V = codes.shape[0]
    index_dtype = torch.int16 if V <= torch.iinfo(torch.int16).max else torch.int32
    rows = []
    for first in range(0, V, chunk):
        part = codes[first : first + chunk]
        dist = torch.cdist(part, codes)
        own = torch.arange(first, first + part.shape[0], device=codes.device)
        dist[torch.arange(part.shape[0]), own] = -1.0  # itself first, whatever ties
        rows.append(dist.topk(k, dim=-1, largest=False, sorted=True).indices.to(index_dtype))
    return torch.cat(rows)
