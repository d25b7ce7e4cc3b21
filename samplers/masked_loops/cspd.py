"""Continuous speculative decoding (CSpD) for MAR: a small MAR drafts gamma steps, the target verifies.

Both models share the generation's plan (order, mask schedule, trajectory noise per position). The
first ``prefill`` fraction of the steps is done by the target alone. Then each iteration drafts gamma
steps with the draft model (each conditioned on the drafts before it), makes one target call, and runs
the trajectory-ratio rule (continuous_acceptance) on every drafted token. Two ways to verify:

- ``steps`` (default): the target call scores drafted step j from the context that includes drafted
  steps 0..j-1 (gamma contexts in one batched call). Steps are kept up to the first step with a rejected
  token in any row; that step's rejected tokens are replaced by residual samples and later drafts are
  dropped (their noise is reused next time: it did not influence the decision). The output is
  distributed exactly as plain MAR at ``num_iter`` with a Gaussian last reverse step
  (``masked_decode(..., gaussian_last_step=True)``), whatever the draft does.
- ``merged`` (the paper's and reference code's scheme): every drafted token is scored from the context of
  the last verification, each accepted or replaced on its own, all kept. Given that context (and its own
  trajectory), each token ends up distributed as the target's prediction for the merged step (gamma steps
  as one, at the merged step's CFG scale) whatever the drafts before it in the round were, so the tokens of
  a round are independent given the context: the output is distributed exactly as the target MAR on
  ``merged_schedule`` (with a Gaussian last step). Target calls are fixed by the schedule, not by
  acceptance.

With LazyMAR-style feature reuse (``MaskedSettings.reuse``; relaxed, so neither mode is exact any more): the
draft's calls inside a round reuse its cache (each round starts with a full call: the verified context differs
from what it drafted), on the schedule of the generation's steps; the target's calls reuse theirs in ``merged``
mode, on the schedule of its own calls (one context per call, as in MAR's sampler), while ``steps`` mode's
calls score several contexts at once and stay full; the diffusion heads of both reuse their MLP outputs.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from ...errors import FastARError, check_choice
from ...model_loaders.mar.diffusion import ReverseStep
from ...model_loaders.mar.loader import check_mar_draft
from .continuous_acceptance import Relaxation, accept, sample_residual
from .masked import Canvas, Guide, MaskedSettings, Plan, at, mask_schedule, record_work, row_index, token_steps
from ..stats import DecodeStats, Stopwatch
from ..token_loops.verifier import ProgressFn, finish

VERIFY_MODES = ("steps", "merged")
REFERENCE_TEMPERATURE = 42.0  # MarkXCloud/CSpD's inner temperature


@dataclass(frozen=True)
class CSpDSettings:
    gamma: int = 8  # draft steps per target call
    prefill: float = 0.05  # fraction of the steps the target does alone first
    verify: str = "steps"
    max_tries: int = 32  # residual proposals per rejected token before a plain target sample
    ratio_temperature: float = 1.0  # relaxed: the last step's exponents over its square (1 = exact; reference: 42)
    path_factor: bool = False  # relaxed: the reference code's intermediate std factor

    @property
    def relaxation(self) -> Relaxation:
        return Relaxation(self.ratio_temperature, self.path_factor)

    @property
    def decoder(self) -> str:
        """"cspd" (exact) or "cspd-relaxed" (the reference code's rule, or part of it)."""
        return "cspd" if self.relaxation.exact else "cspd-relaxed"

    def validate(self) -> "CSpDSettings":
        if self.gamma < 1:
            raise FastARError(f"gamma {self.gamma}: draft at least 1 step per target call (the paper uses 8-32)")
        if not 0.0 <= self.prefill < 1.0:
            raise FastARError(f"pre-fill {self.prefill}: give the fraction of steps the target does alone, in [0, 1) "
                              "(0.05 = the paper's 5%)")
        if self.max_tries < 1:
            raise FastARError(f"max tries {self.max_tries}: allow at least 1 residual proposal")
        if self.ratio_temperature < 1.0:
            raise FastARError(f"CSpD ratio temperature {self.ratio_temperature}: use 1 (exact) or more (relaxed; the "
                              f"reference code's {REFERENCE_TEMPERATURE:g})")
        check_choice("CSpD verify mode", self.verify, VERIFY_MODES)
        return self


@dataclass
class Drafted:
    """One drafted step: its positions [B, n], the draft's last-step Gaussian and tokens, flattened."""

    positions: torch.Tensor
    gaussian: ReverseStep
    values: torch.Tensor


class CSpDRun:
    """One generation's state and counters."""

    def __init__(self, target, draft, conditioning, settings: MaskedSettings, cspd: CSpDSettings, generator,
                 watch: Stopwatch):
        B = conditioning.batch
        self.settings, self.cspd, self.generator, self.watch = settings, cspd, generator, watch
        self.plan = Plan.draw(target, settings, B, generator)
        self.target = Guide(target, conditioning, settings)
        self.draft = Guide(draft, conditioning, settings, like=self.target)
        self.canvas = Canvas(target, B)
        self.stats = DecodeStats(decoder=cspd.decoder + ("" if settings.reuse is None else "+reuse"),
                                 grid=tuple(target.grid), batch=B, baseline_forwards=self.plan.token_steps,
                                 baseline=f"plain MAR at {settings.num_iter} steps",
                                 settings={"model_kind": target.kind, **asdict(settings), **asdict(cspd)})
        self.counts: list[torch.Tensor] = []
        self.accepted = torch.zeros((), dtype=torch.long, device=target.device)
        # the target's cache under reuse (merged mode): its calls so far, how many it makes, what it has not seen
        self.target_calls, self.target_fresh = 0, None
        self.target_schedule = token_steps(merged_schedule(target.cfg.num_tokens, settings, cspd))

    def target_conditions(self, known_count: int, needed: torch.Tensor):
        """The target's condition vectors for one context, the verified one, for a call predicting ``needed``:
        through its cache in merged mode under reuse (``Guide.step_conditions``), else in full."""
        if self.cspd.verify == "merged":
            full = self.target.reuse_full(self.target_calls, self.target_schedule)
            z = self.target.step_conditions(self.canvas.tokens, self.canvas.known, known_count, needed,
                                            self.target_fresh, full)
        else:
            z = self.target.conditions(self.canvas.tokens, self.canvas.known, known_count)
            self.target.count_plain(known_count)
        self.target_calls += 1
        return z

    def target_step(self, step: int) -> None:
        """One plain target step (pre-fill, or the last steps when nothing is left to draft)."""
        positions = self.plan.positions(step)
        z = self.target_conditions(self.plan.known_before(step), positions)
        self.stats.target_forwards += 1
        last = self.target.last_step(*z, positions, self.plan, self.plan.cfg(self.settings, step))
        self.canvas.fix(positions, last.mean + last.std * self.plan.last_noise(positions), self.stats.target_forwards)
        self.target_fresh = positions
        self.counts.append(torch.full((positions.shape[0],), positions.shape[1]))
        self.watch.lap("forward")

    def draft_steps(self, first: int, count: int) -> list[Drafted]:
        tokens, known = self.canvas.tokens.clone(), self.canvas.known.clone()
        drafted, fresh = [], None  # a round starts from the verified context, which the draft's cache never held
        for step in range(first, first + count):
            positions = self.plan.positions(step)
            z = self.draft.step_conditions(tokens, known, self.plan.known_before(step), positions, fresh,
                                           self.draft.reuse_full(step, self.plan.num_steps))
            fresh = positions
            self.stats.drafter_forwards += 1
            gaussian = self.draft.last_step(*z, positions, self.plan, self.plan.cfg(self.settings, step))
            values = gaussian.mean + gaussian.std * self.plan.last_noise(positions)
            rows = row_index(positions)
            tokens[rows, positions] = values.view(*positions.shape, -1)
            known[rows, positions] = torch.ones_like(positions, dtype=torch.bool)
            drafted.append(Drafted(positions, gaussian, values))
        self.watch.lap("draft")
        return drafted

    def score(self, first: int, drafted: list[Drafted]) -> list[ReverseStep]:
        """The target's last-step Gaussian for every drafted token, from one target call."""
        B = self.canvas.tokens.shape[0]
        if self.cspd.verify == "merged":
            z_cond, z_uncond = self.target_conditions(self.plan.known_before(first),
                                                      torch.cat([d.positions for d in drafted], dim=1))
            merged_cfg = self.plan.cfg(self.settings, first + len(drafted) - 1)
            contexts = [(z_cond, z_uncond, merged_cfg)] * len(drafted)
        else:  # context j: the verified tokens plus drafted steps 0..j-1
            tokens, known = [self.canvas.tokens], [self.canvas.known]
            for d in drafted[:-1]:
                t, k = tokens[-1].clone(), known[-1].clone()
                rows = row_index(d.positions)
                t[rows, d.positions] = d.values.view(*d.positions.shape, -1)
                k[rows, d.positions] = torch.ones_like(d.positions, dtype=torch.bool)
                tokens.append(t)
                known.append(k)
            z_cond, z_uncond = self.target.conditions(torch.cat(tokens), torch.cat(known))
            self.target.count_plain(*(self.plan.known_before(first + j) for j in range(len(drafted))))
            contexts = [(z_cond[j * B:(j + 1) * B], None if z_uncond is None else z_uncond[j * B:(j + 1) * B],
                         self.plan.cfg(self.settings, first + j)) for j in range(len(drafted))]
        self.stats.target_forwards += 1
        # every drafted token's reverse process in one batch, each at its step's CFG scale
        conds = torch.cat([at(z_c, d.positions) for d, (z_c, _, _) in zip(drafted, contexts)])
        unconds = None if z_uncond is None else torch.cat([at(z_u, d.positions) for d, (_, z_u, _) in zip(drafted, contexts)])
        scales = torch.cat([torch.full((d.values.shape[0], 1), float(s), device=conds.device)
                            for d, (_, _, s) in zip(drafted, contexts)])
        starts, noises = zip(*(self.plan.trajectory(d.positions) for d in drafted))
        last = self.target.reverse(conds, unconds, scales, torch.cat(starts), torch.cat(noises, dim=1))
        sizes = [d.values.shape[0] for d in drafted]
        self.watch.lap("forward")
        return [ReverseStep(*parts) for parts in zip(last.mean.split(sizes), last.std.split(sizes),
                                                     last.path_log_std.split(sizes))]

    def verify(self, drafted: list[Drafted], scored: list[ReverseStep]) -> int:
        """Accept or replace drafted tokens and fix them; returns the number of steps kept."""
        kept_steps = len(drafted)
        decisions = []
        for j, (d, p) in enumerate(zip(drafted, scored)):
            ok = accept(d.values, p, d.gaussian, self.generator, self.cspd.relaxation)
            all_kept = bool(ok.all())  # the one host sync of a drafted step
            decisions.append((ok, all_kept))
            if self.cspd.verify == "steps" and not all_kept:
                kept_steps = j + 1  # a rejection in any row ends the kept run (rows move together)
                break
        iteration = self.stats.target_forwards
        for d, p, (ok, all_kept) in zip(drafted[:kept_steps], scored, decisions):
            values = d.values.clone()
            rejected = ~ok
            self.stats.drafted_tokens += ok.numel()
            self.accepted = self.accepted + ok.sum()  # on the device: read once, at the end
            if not all_kept:
                residual = sample_residual(ReverseStep(p.mean[rejected], p.std[rejected]),
                                           ReverseStep(d.gaussian.mean[rejected], d.gaussian.std[rejected]),
                                           self.generator, self.cspd.max_tries)
                values[rejected] = residual.values
                self.stats.resample_tries += int(residual.tries.sum())
                self.stats.resample_fallbacks += residual.fallbacks
            self.canvas.fix(d.positions, values, iteration)
        self.target_fresh = torch.cat([d.positions for d in drafted[:kept_steps]], dim=1)
        self.counts.append(torch.full((drafted[0].positions.shape[0],),
                                      sum(d.positions.shape[1] for d in drafted[:kept_steps])))
        self.watch.lap("verify")
        return kept_steps


def round_steps(masked: list[int], step: int, prefill_steps: int, gamma: int) -> int:
    """How many schedule steps the iteration starting at ``step`` (one that predicts tokens) covers: 1 in
    the pre-fill, else up to ``gamma`` drafted steps, ending on one that predicts tokens."""
    if step < prefill_steps:
        return 1
    count = min(gamma, len(masked) - 1 - step)
    return next(c for c in range(count, 0, -1) if masked[step + c] < masked[step + c - 1])


def prefill_steps(cspd: CSpDSettings, num_iter: int) -> int:
    return math.ceil(cspd.prefill * num_iter)


def merged_schedule(num_tokens: int, settings: MaskedSettings, cspd: CSpDSettings) -> list[int]:
    """The mask schedule ``merged`` verification runs: the pre-fill steps as they are, then each round of
    drafted steps as one step (``masked_decode(..., schedule=...)`` samples what merged mode samples)."""
    masked = mask_schedule(num_tokens, settings.num_iter)
    merged, step = [masked[0]], 0
    while step < settings.num_iter:
        empty = masked[step + 1] == masked[step]
        step += 1 if empty else round_steps(masked, step, prefill_steps(cspd, settings.num_iter), cspd.gamma)
        merged.append(masked[step])
    return merged


@torch.no_grad()
def cspd_decode(target, draft, conditioning, settings: MaskedSettings, cspd: CSpDSettings, *, generator,
                on_iteration: Optional[ProgressFn] = None, watch: Optional[Stopwatch] = None):
    """Tokens ``[B, L, C]`` of ``target`` drafted by ``draft``, and their DecodeStats (see the module doc)."""
    check_mar_draft(target, draft)
    L = target.cfg.num_tokens
    settings.validate(L)
    cspd.validate()
    run = CSpDRun(target, draft, conditioning, settings, cspd, generator, watch or Stopwatch(target.device))
    plan, K = run.plan, settings.num_iter
    prefill = prefill_steps(cspd, K)
    step = 0
    while step < K:
        if plan.positions(step).shape[1] == 0:
            step += 1  # a clamped schedule can leave a step nothing to predict
            continue
        if step < prefill:
            run.target_step(step)
            step += 1
        else:
            drafted = run.draft_steps(step, round_steps(plan.masked, step, prefill, cspd.gamma))
            step += run.verify(drafted, run.score(step, drafted))
        if on_iteration is not None:
            on_iteration(L - plan.masked[step], L, run.canvas.tokens)
    run.stats.accepted_tokens = int(run.accepted)
    record_work(run.stats, run.target, run.draft)
    finish(run.stats, run.watch, run.counts, run.canvas.fixed_at, L)
    return run.canvas.tokens, run.stats
