"""Helpers shared by the demo recipes: tensors <-> images, PSNR, the procedural images encoded once and cached
(the training loop's helpers are commands/training.py, which the training commands share)."""
from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from ..commands.training import DATA_DIR, save_fp16, save_whole
from ..errors import FastARError

OUT_DIR = Path(__file__).resolve().parent.parent / "out"  # git-ignored previews


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


ENCODER_SIDE = ("encoder.", "quant_conv.")  # the weights only encoding reads, in LlamaGen's VQ, LDM's and VAR's alike
AUTOENCODER_RECIPES = {"demo_vq": "train_vq", "demo_kl_vae": "train_kl_vae", "demo_var_vqvae": "train_var_vqvae"}


def whole_autoencoder_path(path) -> Path:
    """Where the recipe that wrote the autoencoder ``path`` keeps it whole, encoder included (git-ignored)."""
    return DATA_DIR / "autoencoders" / Path(path).name


def checkpoint_path(out) -> Path:
    """Where a recipe writing ``out`` keeps its training state for ``--resume`` (git-ignored)."""
    return DATA_DIR / "checkpoints" / f"{Path(out).stem}.pt"


def save_autoencoder(model: torch.nn.Module, cfg, out) -> Path:
    """An autoencoder recipe's result: at ``out`` its decoding side only, which is all generation reads (so the
    bundled demo files stay small), and the whole model at ``whole_autoencoder_path(out)`` for the recipes that
    encode images (``encoding_file``). Returns the whole file's path."""
    whole = whole_autoencoder_path(out)
    save_fp16(model, cfg, whole)
    save_fp16(model, replace(cfg, with_encoder=False), out, drop=ENCODER_SIDE)
    return whole


def has_encoder(path: Path) -> bool:
    if path.suffix != ".safetensors":
        return True  # another format: its loader says whether it can encode
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return any(key.startswith("encoder.") for key in f.keys())


def encoding_file(path) -> Path:
    """The file to encode images with for the autoencoder ``path``: the file itself when it holds its encoder,
    else the whole autoencoder its recipe kept (``save_autoencoder``)."""
    path = Path(path)
    if has_encoder(path):
        return path
    whole = whole_autoencoder_path(path)
    if whole.exists():
        return whole
    recipe = AUTOENCODER_RECIPES.get(path.stem, "train_vq, train_kl_vae or train_var_vqvae")
    raise FastARError(f"{path.name} holds only its decoder (the bundled demo autoencoders ship what generation "
                      f"reads); encoding images needs the whole autoencoder, which its recipe keeps at {whole}: "
                      f"run python -m fastar.demo_recipes.{recipe} first")


@torch.no_grad()
def cached_encoding(name: str, autoencoder_path, n: int, seed: int, encode_batch) -> tuple:
    """What ``encode_batch(autoencoder, rng, count)`` makes of ``count`` procedural images, over ``n`` images 64 at
    a time from one generator seeded ``seed``, with the autoencoder ``autoencoder_path`` (its encoder: ``encoding_file``):
    a tuple whose tensors are concatenated and whose lists are joined; cached under ``.data/`` per name, encoding
    file, seed and n."""
    from ..model_loaders import load_image_decoder

    encoder_path = encoding_file(autoencoder_path)
    digest = hashlib.sha1(open(encoder_path, "rb").read()).hexdigest()[:12]
    cache = DATA_DIR / f"{name}_{digest}_s{seed}_n{n}.pt"
    if cache.exists():
        return torch.load(cache)
    autoencoder = load_image_decoder(encoder_path)
    rng = np.random.default_rng(seed)
    parts = []
    for start in range(0, n, 64):
        parts.append(encode_batch(autoencoder, rng, min(64, n - start)))
        if start % 1024 == 0:
            print(f"encoded {start}/{n}", flush=True)
    data = tuple(torch.cat(column) if torch.is_tensor(column[0]) else [item for part in column for item in part]
                 for column in zip(*parts))
    DATA_DIR.mkdir(exist_ok=True)
    save_whole(data, cache)
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

