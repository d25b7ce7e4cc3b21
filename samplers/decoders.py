"""The decoders by name, with their parameters: the one entry point for the CLI, the benchmark and
the nodes."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..errors import FastARError
from .acceptance import GroupedRule
from .jacobi import ProgressFn, ar_decode, jacobi_decode
from .processing import SamplingSettings

DECODERS = ("ar", "sjd", "gsd")
LOSSLESS = {"ar": True, "sjd": True, "gsd": False}


@dataclass(frozen=True)
class DecoderSpec:
    decoder: str = "sjd"
    window: int = 16  # tokens per forward: last fixed token + drafts
    init: str = "random"
    coupling: str = "independent"
    group: int = 10  # GSD cluster size G (1 = SJD)
    prob_threshold: float = 0.15  # GSD: drop cluster members whose p differs more than this
    distance_threshold: float = 0.5  # GSD: keep members among the nearest this fraction of codes

    def as_dict(self) -> dict:
        return asdict(self)


def make_generator(seed: int, device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(int(seed))


def decode(model, conditioning, sampling: SamplingSettings, spec: DecoderSpec, *, seed: int,
           on_iteration: ProgressFn | None = None):
    """Generate image codes ``[B, h*w]`` and their DecodeStats. Same seed, settings and device give
    the same codes."""
    sampling.validate()
    generator = make_generator(seed, model.device)
    if spec.decoder == "ar":
        return ar_decode(model, conditioning, sampling, generator=generator, on_iteration=on_iteration)
    if spec.decoder not in DECODERS:
        raise FastARError(f"unknown decoder '{spec.decoder}': choose one of {', '.join(DECODERS)}")
    rule = None
    if spec.decoder == "gsd":
        rule = GroupedRule(spec.group, model.code_embeddings(), spec.prob_threshold, spec.distance_threshold)
    return jacobi_decode(
        model, conditioning, sampling, generator=generator, window=spec.window, init=spec.init,
        coupling=spec.coupling, rule=rule, name=spec.decoder, on_iteration=on_iteration,
    )
