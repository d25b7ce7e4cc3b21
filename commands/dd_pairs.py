"""DD's training set: noise sequences and the codes the teacher's flow map turns them into (Alg. 1 of the DD
paper), written in shards so that an interrupted run picks up where it stopped.

A folder holds ``manifest.json`` (the teacher's fingerprint, the sampling settings, the classes) and
``pairs_00000.safetensors``... each with ``noise`` [S, N, C] fp32, ``tokens`` [S, N] int32 and ``labels``
[S]. Shard k's noise comes from seed ``seed + k`` and the classes take turns, so every shard is reproducible
on its own and a larger ``per_class`` only adds shards. A folder made with other settings or another teacher
is refused rather than mixed.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ..errors import FastARError
from ..model_loaders.dd.student import model_fingerprint
from ..model_loaders.shared.protocol import ClassConditioning
from ..samplers.decoders import fm_decode, make_generator
from ..samplers.few_step_loops.flow_map import FlowMapSettings, NoiseToCode, token_noise
from ..samplers.few_step_loops.next_scale import RecordedDraw, next_scale_decode
from ..samplers.processing import SamplingSettings
from .training import write_whole


@dataclass(frozen=True)
class PairSettings:
    cfg_scale: float = 2.0  # the DD paper's dataset guidance for LlamaGen and VAR
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    flow_steps: int = 16
    per_class: int = 1000
    shard_size: int = 256
    seed: int = 0

    def tag(self) -> str:
        """The settings that decide the pairs, for a folder name (``per_class`` and shards only add pairs)."""
        return (f"cfg{self.cfg_scale:g}_t{self.temperature:g}_k{self.top_k}_p{self.top_p:g}_f{self.flow_steps}"
                f"_s{self.seed}")

    def sampling(self) -> SamplingSettings:
        return SamplingSettings(self.cfg_scale, self.temperature, self.top_k, self.top_p).validate()


def teacher_codes(teacher, codebook: torch.Tensor, conditioning: ClassConditioning, settings: PairSettings,
                  noise: torch.Tensor, vqvae=None) -> torch.Tensor:
    """The codes ``[B, N]`` the teacher's flow-map sampler makes of ``noise``: token by token for a raster
    model, scale by scale (a scale's tokens in parallel) for VAR, whose ``vqvae`` makes each scale's input."""
    codebook = codebook.float().to(teacher.device)
    if getattr(teacher, "kind", "token-ar") == "next-scale":
        draw = RecordedDraw(NoiseToCode(noise, codebook, FlowMapSettings(steps=settings.flow_steps)).span)
        next_scale_decode(teacher, vqvae, conditioning, settings.sampling(), generator=None, draw=draw, name="fm")
        return draw.codes
    return fm_decode(teacher, conditioning, settings.sampling(), noise, codebook, settings.flow_steps)[0]


def make_pairs(teacher, codebook: torch.Tensor, folder, classes: list[int], settings: PairSettings,
               quiet: bool = False, vqvae=None) -> Path:
    """Fill ``folder`` with the pairs for ``classes`` x ``settings.per_class`` (what is there already is kept).
    ``vqvae``: a VAR teacher's multi-scale VQVAE."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fixed = {k: v for k, v in asdict(settings).items() if k != "per_class"}  # more pairs per class extend a folder
    channels = codebook.shape[1]
    manifest = {"teacher": model_fingerprint(teacher), "grid": list(teacher.grid), "channels": channels,
                "classes": classes, "settings": fixed}
    check_manifest(folder, manifest)
    labels = torch.tensor(classes).repeat(settings.per_class)  # classes interleaved: shard k never changes
    shards = list(torch.split(labels, settings.shard_size))
    n_tokens = token_count(teacher)
    start = time.perf_counter()
    made = 0
    for k, shard_labels in enumerate(shards):
        path = folder / f"pairs_{k:05d}.safetensors"
        if path.exists() and shard_rows(path) == len(shard_labels):
            continue  # a smaller run's short last shard is made again, whole
        noise = token_noise(len(shard_labels), n_tokens, channels, make_generator(settings.seed + k, teacher.device))
        tokens = teacher_codes(teacher, codebook, ClassConditioning(shard_labels.to(teacher.device)), settings, noise,
                               vqvae)
        write_atomically(path, {"noise": noise.float().cpu(), "tokens": tokens.int().cpu(), "labels": shard_labels})
        made += 1
        if not quiet:
            done = sum(len(s) for s in shards[: k + 1])
            rate = made * settings.shard_size / (time.perf_counter() - start)
            left = (len(labels) - done) / max(rate, 1e-9)
            print(f"\rDD pairs: shard {k + 1}/{len(shards)}, {done}/{len(labels)} sequences, {rate:.1f}/s, "
                  f"about {left / 60:.0f} min left", end="", file=sys.stderr, flush=True)
    if not quiet and made:
        print(file=sys.stderr)
    return folder


def shard_rows(path: Path) -> int | None:
    """The pairs a shard holds, read from its header (None if it is damaged: it is made again)."""
    try:
        with safe_open(str(path), "pt") as f:
            return f.get_slice("labels").get_shape()[0]
    except (SafetensorError, OSError):
        return None


def token_count(model) -> int:
    """The tokens of one image: the grid's for a raster model, every scale's for VAR."""
    return model.cfg.seq_len if getattr(model, "kind", "token-ar") == "next-scale" else model.grid[0] * model.grid[1]


def check_manifest(folder: Path, manifest: dict) -> None:
    path = folder / "manifest.json"
    if path.exists():
        saved = json.loads(path.read_text())
        if saved != json.loads(json.dumps(manifest)):
            changed = sorted(k for k in manifest if saved.get(k) != json.loads(json.dumps(manifest[k])))
            raise FastARError(f"{folder} holds DD pairs made with another {', '.join(changed)}: give another --data "
                              "folder, or the same teacher and settings to resume it")
    else:
        path.write_text(json.dumps(manifest, indent=1))


def write_atomically(path: Path, tensors: dict) -> None:
    """An interrupted run never leaves a half shard behind."""
    write_whole(path, lambda file: save_file({k: v.contiguous() for k, v in tensors.items()}, str(file)))


def load_pairs(folder) -> dict[str, torch.Tensor]:
    """Every shard of ``folder`` concatenated: ``noise`` [M, N, C], ``tokens`` [M, N] int64, ``labels`` [M]."""
    shards = sorted(Path(folder).glob("pairs_*.safetensors"))
    if not shards:
        raise FastARError(f"{folder} holds no DD pairs (pairs_*.safetensors): run distill-dd with --data there first")
    parts = []
    for shard in shards:
        try:
            parts.append(load_file(str(shard)))
        except (SafetensorError, OSError) as e:
            raise FastARError(f"{shard} is damaged ({e}): delete it and run again to regenerate it") from e
    return {"noise": torch.cat([p["noise"] for p in parts]), "tokens": torch.cat([p["tokens"] for p in parts]).long(),
            "labels": torch.cat([p["labels"] for p in parts]).long()}
