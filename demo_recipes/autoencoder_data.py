"""What the demo autoencoders (VQ tokenizer, KL autoencoder) train on: random crops of a pool of procedural
images, judged on balanced held-out images; and the command-line options the two trainings share."""
from __future__ import annotations

import argparse

import numpy as np
import torch

from .demo_common import to_tensor
from ..commands.bench.demo_data import balanced_labels, make_batch

HELD_OUT = 256


def parser(description: str, *, steps: int, lr: float, out: str, texture: float = 0.0,
           held_out: int = HELD_OUT) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--crop", type=int, default=64)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--pool", type=int, default=2048, help="procedural images to crop from")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--texture", type=float, default=texture,
                   help="the images' texture, its largest excursion in 8-bit levels (0: flat colours)")
    p.add_argument("--held-out", type=int, default=held_out, help="held-out images judged at the end (16 or more)")
    p.add_argument("--out", default=out)
    return p


def images(seed: int, pool_size: int, texture_levels: float = 0.0,
           held_out: int = HELD_OUT) -> tuple[np.random.Generator, np.ndarray, torch.Tensor]:
    """The crop generator, the pool of training images and ``held_out`` held-out images (their own seed)."""
    rng = np.random.default_rng(seed)
    texture = texture_levels / 255
    pool, _ = make_batch(rng, pool_size, texture=texture)
    judged = to_tensor(make_batch(np.random.default_rng(10_000 + seed), held_out, balanced_labels(held_out),
                                  texture=texture)[0])
    return rng, pool, judged


def crop_batch(pool: np.ndarray, rng: np.random.Generator, batch: int, size: int) -> torch.Tensor:
    idx = rng.integers(0, len(pool), batch)
    ys, xs = rng.integers(0, pool.shape[1] - size + 1, (2, batch))
    crops = np.stack([pool[i, y : y + size, x : x + size] for i, y, x in zip(idx, ys, xs)])
    flip = rng.random(batch) < 0.5
    crops[flip] = crops[flip, :, ::-1]
    return to_tensor(crops)
