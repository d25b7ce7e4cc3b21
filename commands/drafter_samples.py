"""The images a drafter trains on: the target's own samples, each with what it was generated for (a class, or a
prompt), cached under ``.data/`` keyed by the target file, the prompts and the seed."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from ..errors import FastARError
from ..model_loaders.shared.protocol import ClassConditioning, PromptConditioning
from ..samplers.processing import SamplingSettings
from ..samplers.token_loops.jacobi import ar_decode
from .bench.demo_data import CLASS_NAMES, caption
from .training import save_whole


class Conditions:
    """What each sample was generated for: class labels [n] or prompts; ``batch(idx)`` is the target's conditioning
    of those samples (prompts encoded by the target's tokenizer, or by ``encoder`` for LlamaGen's T5 features)."""

    def __init__(self, labels: torch.Tensor | None = None, prompts: list[str] | None = None, encoder=None):
        self.labels, self.prompts, self.encoder = labels, prompts, encoder

    def __len__(self) -> int:
        return len(self.labels) if self.labels is not None else len(self.prompts)

    def batch(self, idx) -> object:
        idx = torch.as_tensor(idx).tolist()
        if self.labels is not None:
            return ClassConditioning(self.labels[idx])
        prompts = [self.prompts[i] for i in idx]
        if self.encoder is None:
            return PromptConditioning(prompts)
        from ..model_loaders.llamagen.t5 import encode_captions

        return encode_captions(self.encoder, prompts)


def demo_captions(n: int, seed: int) -> list[str]:
    """``n`` captions of the demo images' kind ("a red ring on a cyan background"), drawn at random."""
    rng = np.random.default_rng(seed)
    return [caption(int(label), bits) for label, bits in zip(rng.integers(0, len(CLASS_NAMES), n),
                                                             rng.integers(0, 2, (n, 3)))]


def read_captions(path) -> list[str]:
    """One prompt per non-empty line of a text file."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise FastARError(f"--captions {path}: cannot read it ({error}); give a UTF-8 text file, one prompt per line")
    prompts = [line.strip() for line in lines if line.strip()]
    if not prompts:
        raise FastARError(f"--captions {path} holds no prompt: write one prompt per line")
    return prompts


def draw_conditions(target, n: int, seed: int, captions: list[str] | None, encoder) -> Conditions:
    """Random classes for a class-to-image target; prompts for a text-to-image one: drawn from ``captions``, or the
    demo's captions."""
    generator = torch.Generator().manual_seed(seed)
    if getattr(target, "conditioning_kind", "class") == "class":
        return Conditions(labels=torch.randint(0, target.cfg.num_classes, (n,), generator=generator))
    if captions is None:
        return Conditions(prompts=demo_captions(n, seed), encoder=encoder)
    picks = torch.randint(0, len(captions), (n,), generator=generator).tolist()
    return Conditions(prompts=[captions[i] for i in picks], encoder=encoder)


@torch.no_grad()
def target_samples(target, path, conditions: Conditions, seed: int, batch: int, cache_dir: Path) -> torch.Tensor:
    """The target's codes [n, N] (int16) for ``conditions``, by plain AR sampling at FastAR's defaults (cfg 2.0,
    temperature 1, no top-k); cached when the target is a single file or a folder with one weights file."""
    cache = cache_file(path, conditions, seed, cache_dir)
    if cache is not None and cache.exists():
        return torch.load(cache)
    generator = torch.Generator(device=target.device).manual_seed(seed)
    tokens = []
    for start in range(0, len(conditions), batch):
        idx = list(range(start, min(start + batch, len(conditions))))
        codes, _ = ar_decode(target, conditions.batch(idx), SamplingSettings(), generator=generator)
        tokens.append(codes.cpu().to(torch.int16))
        print(f"sampled {idx[-1] + 1}/{len(conditions)} target images", flush=True)
    data = torch.cat(tokens)
    if cache is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        save_whole(data, cache)
    return data


def cache_file(path, conditions: Conditions, seed: int, cache_dir: Path) -> Path | None:
    path = Path(path)
    weights = [path] if path.is_file() else sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if len(weights) != 1:
        return None
    digest = hashlib.sha1(weights[0].read_bytes())
    digest.update(repr(conditions.labels.tolist() if conditions.labels is not None else conditions.prompts).encode())
    return cache_dir / f"drafter_samples_{digest.hexdigest()[:12]}_s{seed}_n{len(conditions)}.pt"
