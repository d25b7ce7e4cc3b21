"""The quantiser step the VQ image decoders share: latents to the indices of their nearest code vectors."""
from __future__ import annotations

import torch


def nearest_codes(z: torch.Tensor, book: torch.Tensor) -> torch.Tensor:
    """Codes ``[B, h, w]`` of latents ``[B, C, h, w]``: the nearest row of ``book`` ``[V, C]`` in squared L2,
    expanded as |z|^2 + |e|^2 - 2 z.e the way the official quantisers compute it, in fp32 (lowest index on
    ties)."""
    flat = z.permute(0, 2, 3, 1).reshape(-1, z.shape[1]).float()
    book = book.float()
    distances = flat.pow(2).sum(1, keepdim=True) + book.pow(2).sum(1) - 2 * flat @ book.T
    return distances.argmin(1).view(z.shape[0], *z.shape[2:])
