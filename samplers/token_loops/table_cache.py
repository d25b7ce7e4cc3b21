"""Per-codebook tables (LANTERN's latent neighbours, GSD's neighbourhood radii), computed once per table
and kept where the table lives, so a generation only gathers rows from them.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch

_CACHE: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_CACHE_SIZE = 8


def cached_table(kind: str, codes: torch.Tensor, params: tuple,
                 compute: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``compute(codes)`` for this table's content and ``params``, from the cache when it is there."""
    key = (kind, *fingerprint(codes), *params)
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    table = compute(codes)
    _CACHE[key] = table
    if len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return table


FINGERPRINT_CHUNK = 1 << 22  # values read at once: float64 temporaries of a whole 7B table are gigabytes


def fingerprint(codes: torch.Tensor) -> tuple:
    """Identifies a table by content (loaders may hand out a fresh tensor per call): its sum and its
    position-weighted sum, in float64."""
    flat = codes.reshape(-1)
    total = weighted = torch.zeros((), dtype=torch.float64, device=codes.device)
    for start in range(0, flat.numel(), FINGERPRINT_CHUNK):
        part = flat[start:start + FINGERPRINT_CHUNK].double()
        position = torch.arange(start + 1, start + 1 + part.numel(), device=codes.device, dtype=torch.float64)
        total, weighted = total + part.sum(), weighted + (part * position).sum()
    return tuple(codes.shape), str(codes.device), float(total), float(weighted)
