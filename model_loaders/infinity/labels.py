"""Infinity's bits as the release's integer labels (its lfq mask: bit 0 the most significant), per VAE cell: what
``--tokens-out`` writes for an Infinity model and ``decode --tokens-in`` reads back through the BSQ VAE."""
from __future__ import annotations

import torch

from ...errors import FastARError


def powers(bits: int, device=None) -> torch.Tensor:
    return 2 ** torch.arange(bits - 1, -1, -1, device=device, dtype=torch.int64)


def labels_of(bits: torch.Tensor) -> torch.Tensor:
    """Bits ``[..., d]`` (0/1) -> labels ``[...]`` (int64)."""
    return (bits.long() * powers(bits.shape[-1], bits.device)).sum(-1)


def bits_of(labels: torch.Tensor, bits: int) -> torch.Tensor:
    """Labels ``[...]`` -> bits ``[..., d]``."""
    return labels[..., None].div(powers(bits, labels.device), rounding_mode="floor") % 2


def f_hat_of_labels(vae, scales: list, tokens: list, bits: int, source: str, grid=None) -> torch.Tensor:
    """The VAE's f_hat ``[B, d, H, W]`` of a tokens file's labels: ``tokens`` [image][scale][h*w] over the VAE-grid
    ``scales`` [(h, w), ...], ``bits`` a label; ``grid`` (H, W), where the last scales were skipped."""
    if bits != vae.cfg.codebook_dim:
        raise FastARError(f"{source} holds labels of {bits} bits but the VAE codes {vae.cfg.codebook_dim}: use the "
                          "VAE of the model that wrote it")
    drawn = [tuple(s) for s in scales]
    scales = drawn if grid is None or tuple(grid) == drawn[-1] else [*drawn, tuple(grid)]
    f_hat = torch.zeros(len(tokens), bits, *scales[-1], device=vae.device)
    for scale, (h, w) in enumerate(drawn):
        labels = torch.tensor([row[scale] for row in tokens], dtype=torch.int64, device=vae.device)
        if labels.shape[1] != h * w or int(labels.min()) < 0 or int(labels.max()) >= 2 ** bits:
            raise FastARError(f"{source}: scale {scale} should hold {h * w} labels in 0..{2 ** bits - 1} per image: "
                              "give the JSON --tokens-out wrote")
        f_hat, _ = vae.next_input(f_hat, bits_of(labels.view(-1, h, w), bits), scale, scales)
    return f_hat
