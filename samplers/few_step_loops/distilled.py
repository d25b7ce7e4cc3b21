"""Distilled Decoding sampling (decoders.md, "DD"): a student maps one noise sequence to the whole image in
one or two forwards.

Noise ``[B, N, C]`` (raster order, channel-last, codebook space) is the same array at every step. A step at
t feeds the current sequence's first t positions as data and the noise elsewhere; the student predicts
every final token; positions before t keep their input. Of the prediction, positions before ``split`` take
the code of the logits' argmax (greedy) and the others the raw continuous output, never quantised, neither
for the image decoder nor when fed back. Steps: ``1`` = {0}, ``2`` = {0, t2}. Deterministic given the
noise and the class. The hybrid (``Hybrid``) lets the teacher resample part of the sequence between the steps.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from ...errors import FastARError
from ...model_loaders.shared.protocol import ClassConditioning
from .flow_map import nearest_code
from ..token_loops.jacobi import ar_decode
from ..processing import SamplingSettings
from ..stats import DecodeStats, Stopwatch
from ..token_loops.verifier import ProgressFn


@dataclass(frozen=True)
class DDSettings:
    steps: int = 1  # 1 or 2
    t2: Optional[int] = None  # the second step's data length (None: the student's own)
    split: Optional[int] = None  # greedy codes before it, continuous outputs from it (None: the student's own)
    regenerate: Optional[int] = None  # hybrid: the teacher resamples positions regenerate..t2-1 between the steps

    def resolve(self, student) -> "DDSettings":
        """These settings with the student's defaults filled in, checked against its token count."""
        n = student.num_tokens
        t2 = student.cfg.t2 if self.t2 is None else self.t2
        split = student.cfg.split if self.split is None else self.split
        if split is None or (t2 is None and self.steps == 2):
            why = getattr(student.cfg, "unknown_split", "") or f"{student.what} does not say where its split lies"
            raise FastARError(f"{why}: give the split in tokens (--dd-split, and --dd-t2 for two steps; in ComfyUI "
                              "the DD sampler's split and t2), or the student's split_t in its NAME.json")
        resolved = DDSettings(self.steps, split if t2 is None else t2, split, self.regenerate)
        if resolved.steps not in (1, 2):
            raise FastARError(f"Distilled Decoding runs 1 or 2 steps, not {resolved.steps}")
        if resolved.steps == 2 and not 0 < resolved.t2 < n:  # one step (t = 0 only) has no t2
            raise FastARError(f"the second DD step's t2 = {resolved.t2} must lie in 1..{n - 1} (the image has {n} "
                              "tokens); the released students were trained with 80")
        if not 0 <= resolved.split <= n:
            raise FastARError(f"the DD split {resolved.split} must lie in 0..{n} (the image has {n} tokens)")
        if resolved.regenerate is not None and (resolved.steps != 2 or not 0 <= resolved.regenerate < resolved.t2):
            raise FastARError(f"the teacher regenerates positions s..t2-1 between two DD steps: give 2 steps and s in "
                              f"0..{resolved.t2 - 1} (got {resolved.steps} steps, s = {resolved.regenerate})")
        return resolved

    def hybrid(self, student, regenerate: Optional[int] = None) -> "DDSettings":
        """Two steps between which the teacher regenerates from ``regenerate`` (None: t2 // 2, the paper's
        middle ground), resolved against ``student``."""
        two = replace(self, steps=2, regenerate=None).resolve(student)
        return replace(two, regenerate=two.t2 // 2 if regenerate is None else regenerate).resolve(student)

    @property
    def schedule(self) -> tuple[int, ...]:
        return (0,) if self.steps == 1 else (0, self.t2)


def dd_step(student, x: torch.Tensor, noise: torch.Tensor, labels: torch.Tensor, t: int, split: int,
            codebook: torch.Tensor) -> torch.Tensor:
    """One DD step from the current sequence ``x`` [B, N, C]: the next sequence, ``[B, N, C]`` fp32."""
    position = torch.arange(x.shape[1], device=x.device)[None, :, None]
    x_t = torch.where(position < t, x, noise)
    continuous, logits = student.predict(x_t, labels, t)
    greedy = codebook[logits.argmax(-1)]
    kept = codebook[nearest_code(x_t.flatten(0, 1), codebook).view(x.shape[:2])]  # an input code, read back
    greedy = torch.where(position < t, kept, greedy)
    continuous = torch.where(position < t, x_t.float(), continuous)
    return torch.where(position < split, greedy, continuous)


@dataclass
class Hybrid:
    """The DD paper's Alg. 4: after DD's first step the teacher, at its own sampling settings, keeps the first
    ``settings.regenerate`` codes and samples the positions up to t2 itself; DD's second step finishes."""

    teacher: object  # the student's teacher (token-AR)
    sampling: SamplingSettings
    generator: torch.Generator

    def fill(self, x: torch.Tensor, labels: torch.Tensor, settings: DDSettings, codebook: torch.Tensor):
        """The sequence after DD's first step -> the teacher's codes as vectors up to t2; and its forwards."""
        kept = nearest_code(x[:, : settings.regenerate].flatten(0, 1), codebook).view(x.shape[0], -1)
        codes, stats = ar_decode(self.teacher, ClassConditioning(labels), self.sampling, generator=self.generator,
                                 prefix=kept, stop=settings.t2)
        return torch.cat([codebook[codes], x[:, settings.t2 :]], dim=1), stats.target_forwards


@torch.no_grad()
def dd_decode(student, labels: torch.Tensor, noise: torch.Tensor, codebook: torch.Tensor,
              settings: DDSettings = DDSettings(), *, on_iteration: Optional[ProgressFn] = None,
              hybrid: Optional[Hybrid] = None):
    """Latents ``[B, N, C]`` (the image decoder's input in raster order) and their DecodeStats."""
    settings = settings.resolve(student)
    if (hybrid is None) != (settings.regenerate is None):
        raise FastARError("the hybrid needs both the teacher and the position it regenerates from")
    B, N, C = noise.shape
    if N != student.num_tokens or C != student.cfg.channels:
        raise FastARError(f"the noise is [{B}, {N}, {C}] but this student needs [B, {student.num_tokens}, "
                          f"{student.cfg.channels}]: give noise of that shape (or none, for seeded noise)")
    if codebook.shape != (student.vocab_size, student.cfg.channels):
        raise FastARError(f"the VQ codebook is {tuple(codebook.shape)} but the student predicts {student.vocab_size} "
                          f"codes of width {student.cfg.channels}: load the VQ decoder of the student's teacher")
    watch = Stopwatch(student.device)
    noise, codebook = noise.to(student.device).float(), codebook.to(student.device).float()
    x, teacher_forwards = noise, 0
    for step, t in enumerate(settings.schedule):
        if hybrid is not None and step == 1:
            x, teacher_forwards = hybrid.fill(x, labels, settings, codebook)
        x = dd_step(student, x, noise, labels, t, settings.split, codebook)
        if on_iteration is not None:
            on_iteration(step + 1, len(settings.schedule), x)
    watch.lap("forward")
    stats = DecodeStats(decoder="dd", grid=tuple(student.grid), batch=B, tokens=N,
                        target_forwards=len(settings.schedule) + teacher_forwards,
                        baseline=f"its teacher's {student.teacher_sampler[0]}",
                        baseline_forwards=student.teacher_sampler[1],
                        fixed_per_forward=[[n] * B for n in fixed_per_forward(settings, N, teacher_forwards)],
                        settings={"steps": settings.steps, "t2": settings.t2, "split": settings.split,
                                  "regenerate": settings.regenerate, "teacher_forwards": teacher_forwards,
                                  "teacher_sampler": list(student.teacher_sampler)})
    stats.fixed_at = [[forward for forward, n in enumerate(stats.fixed_per_forward, 1) for _ in range(n[0])]] * B
    stats.wall_time_s = stats.forward_time_s = watch.elapsed()
    return x, stats


def fixed_per_forward(settings: DDSettings, tokens: int, teacher_forwards: int) -> list[int]:
    """The tokens each forward leaves for good, in raster order: the first step its first t2 (all of them in one
    step), the second the rest; with the hybrid, the first step only the codes the teacher keeps, the teacher
    one token per forward up to t2."""
    if settings.steps == 1:
        return [tokens]
    kept = settings.t2 if settings.regenerate is None else settings.regenerate
    return [kept, *[1] * teacher_forwards, tokens - settings.t2]
