"""Helpers shared by the demo training tools: tensors <-> images, fp16 safetensors with config, schedules."""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file


DATA_DIR = Path(__file__).resolve().parent.parent / ".data"  # git-ignored caches
OUT_DIR = Path(__file__).resolve().parent.parent / "out"  # git-ignored previews


def setup(seed: int) -> torch.Generator:
    """Two CPU threads (the machine is shared), global seeds for module init, a generator for the rest."""
    torch.set_num_threads(2)
    torch.set_flush_denormal(True)  # cheap insurance: denormal floats are very slow on CPUs
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def to_tensor(images) -> torch.Tensor:
    """uint8 [B, H, W, 3] (numpy or torch) -> float [B, 3, H, W] in [-1, 1]."""
    x = torch.as_tensor(np.asarray(images)) if not torch.is_tensor(images) else images
    return x.permute(0, 3, 1, 2).contiguous().float() / 127.5 - 1.0


def to_uint8(x: torch.Tensor) -> np.ndarray:
    """float [B, 3, H, W] in [-1, 1] -> uint8 [B, H, W, 3]."""
    return ((x.detach().float().clamp(-1, 1) + 1) * 127.5 + 0.5).to(torch.uint8).permute(0, 2, 3, 1).numpy()


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR in dB of images in [-1, 1] (peak-to-peak 2)."""
    mse = (a.clamp(-1, 1) - b.clamp(-1, 1)).pow(2).mean().item()
    return 10 * np.log10(4.0 / max(mse, 1e-12))


def save_fp16(module: torch.nn.Module, cfg, path, keep_fp32: tuple[str, ...] = ()) -> None:
    """State dict in fp16 (official key names; keys starting with ``keep_fp32`` stay fp32) with the config as
    JSON under ``fastar_config``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sd = {k: (v.half() if v.is_floating_point() and not k.startswith(keep_fp32) else v).detach().contiguous()
          for k, v in module.state_dict().items()}
    meta = asdict(cfg) if not isinstance(cfg, dict) else cfg
    partial = path.with_name(path.name + ".partial")  # then renamed: an interrupted save never leaves half a file
    save_file(sd, str(partial), metadata={"fastar_config": json.dumps(meta)})
    os.replace(partial, path)
    print(f"saved {path.name}: {path.stat().st_size / 1e6:.2f} MB")


def cosine_lr(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warmup then cosine decay to ``floor * peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + np.cos(np.pi * min(t, 1.0))))


class Timer:
    def __init__(self):
        self.start = time.time()

    def __str__(self):
        return f"{time.time() - self.start:.0f}s"


@torch.no_grad()
def cached_encoding(name: str, decoder_path, n: int, seed: int, encode_batch) -> tuple:
    """What ``encode_batch(decoder, rng, count)`` makes of ``count`` procedural images, over ``n`` images 64 at a
    time from one generator seeded ``seed``, with the image decoder at ``decoder_path``: a tuple whose tensors are
    concatenated and whose lists are joined; cached under ``.data/`` per name, decoder file, seed and n."""
    from ..model_loaders import load_image_decoder

    digest = hashlib.sha1(open(decoder_path, "rb").read()).hexdigest()[:12]
    cache = DATA_DIR / f"{name}_{digest}_s{seed}_n{n}.pt"
    if cache.exists():
        return torch.load(cache)
    decoder = load_image_decoder(decoder_path)
    rng = np.random.default_rng(seed)
    parts = []
    for start in range(0, n, 64):
        parts.append(encode_batch(decoder, rng, min(64, n - start)))
        if start % 1024 == 0:
            print(f"encoded {start}/{n}", flush=True)
    data = tuple(torch.cat(column) if torch.is_tensor(column[0]) else [item for part in column for item in part]
                 for column in zip(*parts))
    DATA_DIR.mkdir(exist_ok=True)
    torch.save(data, cache)
    return data


def tokenised(name: str, vq_path, n: int, seed: int, draw) -> tuple:
    """(codes int16 [n, h*w], *extras) of ``n`` procedural images drawn by ``draw(rng, count)`` -> (images
    uint8, labels array, *more), encoded with the VQ at ``vq_path`` (cached_encoding). Arrays become tensors,
    lists (captions) stay lists."""
    def encode_batch(vq, rng, count):
        images, *more = draw(rng, count)
        codes = vq.encode(to_tensor(images)).flatten(1).to(torch.int16)
        return (codes, *(torch.from_numpy(x) if isinstance(x, np.ndarray) else x for x in more))

    return cached_encoding(f"{name}_tokens", vq_path, n, seed, encode_batch)

