"""MAR's own sampler over the masked-AR protocol: the baseline (``--decoder ar``) of continuous-token models.

Each of ``num_iter`` steps runs the transformer on the tokens known so far (cond and uncond rows in one
call under CFG), then the diffusion head samples the tokens of this step, all in parallel:
- order: a random permutation per image from the seeded generator; the tokens still masked after step s
  are the first ``m[s+1]`` of the order, so step s predicts ``order[m[s+1]:m[s]]``;
- mask schedule: m[s+1] = floor(L * cos(pi/2 * (s+1)/K)) clamped to [1, m[s] - 1], and the last step
  predicts every token left;
- CFG on the head's eps; the ``linear`` schedule scales it by (L - m[s+1]) / L with the clamped length,
  so it never reaches the nominal cfg;
- temperature scales the noise of every reverse step (not x_T); the last reverse step adds no noise.
Trajectory noise (x_T and each reverse step's noise) is drawn per token position up front, so two heads
(a target and a draft, for CSpD) can follow the same trajectory for the same position.
"""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from ...errors import FastARError, check_choice
from ...model_loaders.mar.diffusion import ReverseStep
from ...model_loaders.mar.lazy import LazyFeatures
from ...model_loaders.shared.compiled import compiled_function, compiled_mode, without_graphs
from .feature_reuse import FeatureReuse
from .head_steps import reverse_process
from ..stats import DecodeStats, Stopwatch
from ..token_loops.verifier import ProgressFn, finish

CFG_SCHEDULES = ("linear", "constant")


@dataclass
class MaskedSettings:
    """The knobs of MAR's sampler (its paper's defaults: 64 steps, linear CFG, 100 diffusion steps)."""

    num_iter: int = 64
    cfg_scale: float = 1.0
    cfg_schedule: str = "linear"
    temperature: float = 1.0
    diffusion_steps: int = 100
    reuse: FeatureReuse | None = None  # LazyMAR-style feature reuse (relaxed); None: every step in full

    def validate(self, num_tokens: int) -> "MaskedSettings":
        if not 1 <= self.num_iter <= num_tokens:
            raise FastARError(f"num_iter {self.num_iter}: MAR fixes at least one token per step, so choose 1 to "
                              f"{num_tokens} steps for this model's {num_tokens} tokens (64 is MAR's default)")
        if self.cfg_scale < 1.0:
            raise FastARError(f"cfg scale {self.cfg_scale}: use 1 (off) or more")
        if self.temperature <= 0:
            raise FastARError(f"temperature {self.temperature}: MAR's diffusion head needs a positive temperature "
                              "(it scales the noise of each reverse step; 1 = as trained)")
        check_choice("CFG schedule", self.cfg_schedule, CFG_SCHEDULES)
        if self.reuse is not None:
            self.reuse.validate()
        return self


def mask_schedule(num_tokens: int, num_iter: int) -> list[int]:
    """``m[0..K]``: tokens still masked before each step (m[0] = L) and after the last (m[K] = 0)."""
    masked = [num_tokens]
    for step in range(num_iter - 1):
        nominal = math.floor(num_tokens * math.cos(math.pi / 2 * (step + 1) / num_iter))
        masked.append(max(1, min(masked[-1] - 1, nominal)))
    return masked + [0]


def cfg_at(settings: MaskedSettings, num_tokens: int, masked_after: int) -> float:
    """The guidance scale of a step after which ``masked_after`` tokens stay masked (the clamped length,
    which the official sampler takes as 1 at the last step)."""
    if settings.cfg_schedule == "constant":
        return settings.cfg_scale
    return 1 + (settings.cfg_scale - 1) * (num_tokens - max(masked_after, 1)) / num_tokens


def row_index(positions: torch.Tensor) -> torch.Tensor:
    """``[B, 1]`` row numbers, to index ``[B, L, ...]`` tensors at ``positions`` [B, n]."""
    return torch.arange(positions.shape[0], device=positions.device).unsqueeze(1)


@dataclass
class Trajectories:
    """x_T ``[B, L, C]`` and every reverse step's noise ``[S, B, L, C]``, per token position; ``noise[0]``
    is the last step's, which only CSpD's target (a Gaussian last step) uses."""

    start: torch.Tensor
    noise: torch.Tensor

    @classmethod
    def draw(cls, generator, batch: int, num_tokens: int, channels: int, steps: int, device) -> "Trajectories":
        start = torch.randn(batch, num_tokens, channels, generator=generator, device=device)
        noise = torch.randn(steps, batch, num_tokens, channels, generator=generator, device=device)
        return cls(start, noise)


def token_steps(masked: list[int]) -> int:
    """The steps of a mask schedule that predict tokens (a clamped one can leave a step none): a plain run's
    forwards."""
    return sum(after < before for before, after in zip(masked, masked[1:]))


@dataclass
class Plan:
    """What every model of one generation shares: the random order per image, the mask schedule and the
    trajectory noise per position (so a target and a draft follow the same trajectory)."""

    order: torch.Tensor  # [B, L]
    masked: list[int]  # tokens still masked before each step
    paths: Trajectories

    @classmethod
    def draw(cls, model, settings: MaskedSettings, batch: int, generator, masked: list[int] | None = None) -> "Plan":
        """A fresh plan on MAR's cosine schedule at ``settings.num_iter``, or on the schedule ``masked``."""
        L, C, device = model.cfg.num_tokens, model.cfg.token_dim, model.device
        order = torch.stack([torch.randperm(L, generator=generator, device=device) for _ in range(batch)])
        steps = model.diffusion(settings.diffusion_steps).num_steps
        masked = mask_schedule(L, settings.num_iter) if masked is None else masked
        return cls(order, masked, Trajectories.draw(generator, batch, L, C, steps, device))

    @property
    def num_steps(self) -> int:
        return len(self.masked) - 1

    @property
    def num_tokens(self) -> int:
        return self.masked[0]

    @property
    def token_steps(self) -> int:
        return token_steps(self.masked)

    def known_before(self, step: int) -> int:
        """Tokens every row knows before ``step``."""
        return self.num_tokens - self.masked[step]

    def positions(self, step: int) -> torch.Tensor:
        """``[B, n]``: the positions step ``step`` predicts (empty when the clamped schedule gives none)."""
        return self.order[:, self.masked[step + 1]: self.masked[step]]

    def cfg(self, settings: MaskedSettings, step: int) -> float:
        return cfg_at(settings, self.num_tokens, self.masked[step + 1])

    def trajectory(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x_T ``[N, C]`` and noise ``[S, N, C]`` of ``positions`` [B, n], flattened row by row."""
        rows = row_index(positions)
        return self.paths.start[rows, positions].flatten(0, 1), self.paths.noise[:, rows, positions].flatten(1, 2)

    def last_noise(self, positions: torch.Tensor) -> torch.Tensor:
        """The last reverse step's noise of ``positions`` [B, n], flattened: ``[B * n, C]``."""
        return self.paths.noise[0][row_index(positions), positions].flatten(0, 1)


class Guide:
    """One model's side of a generation: its class vectors (and unconditional ones under CFG), its transformer call
    and its head, compiled or eager."""

    def __init__(self, model, conditioning, settings: MaskedSettings, like: "Guide | None" = None):
        """``like``: the guide whose steps this one's follow, compiled or eager (a CSpD draft's, its target's); by
        default ``model``'s compile switch decides."""
        self.model, self.settings = model, settings
        self.compile_mode = like.compile_mode if like is not None else compiled_mode(model)
        self.transformer = model.conditions if self.compile_mode is None else \
            functools.partial(compiled_conditions(type(model), self.compile_mode), model)
        self.diffusion = model.diffusion(settings.diffusion_steps)
        self.cond = model.class_vectors(conditioning, uncond=False)
        self.uncond = model.class_vectors(conditioning, uncond=True) if settings.cfg_scale != 1.0 else None
        self.lazy = None if settings.reuse is None else LazyFeatures(model)
        self.work: list[tuple[int, int]] = []  # per step under feature reuse: transformer work done, a plain step's

    def reuse_full(self, index: int, count: int) -> bool:
        """Whether call ``index`` of the ``count`` this guide makes in a generation is a full one under the reuse
        schedule (always, without reuse)."""
        return self.settings.reuse is None or self.settings.reuse.full_steps(count)[index]

    def step_conditions(self, tokens, known, known_count: int, needed: torch.Tensor, fresh: torch.Tensor | None,
                        full: bool):
        """Condition vectors ``(z_cond, z_uncond)`` for a call that predicts ``needed`` [B, m]: plain, or under
        feature reuse a full call that refills the cache (``full``, or ``fresh`` None: the cache does not hold
        this context) or one that reuses it (``fresh``: the positions fixed since the cache's last call). A
        reusing call's vectors are valid at ``needed`` only."""
        if self.lazy is None:
            return self.conditions(tokens, known, known_count)
        plain = self.plain_work(known_count)
        if full or fresh is None:
            self.count_work(plain, plain)
            return self.lazy.refresh(tokens, known, self.cond, self.uncond, known_count)
        keep = self.settings.reuse.keep(self.lazy.slots, needed.shape[1] + fresh.shape[1])
        self.count_work(self.lazy.reused_work(fresh.shape[1], keep), plain)
        return self.lazy.reuse(tokens, self.cond, fresh, needed, keep)

    def count_work(self, done: int, plain: int) -> None:
        """A call's transformer work under reuse, and a plain call's, in slot-blocks weighted by the model's
        width squared (what a slot through a block costs), so two models' calls add up."""
        if self.lazy is not None:
            self.work.append((done * self.model.cfg.dim ** 2, plain * self.model.cfg.dim ** 2))

    def plain_work(self, known_count: int) -> int:
        """A full call's transformer work (slot-blocks) over ``known_count`` known tokens, both CFG branches."""
        return self.lazy.full_work(known_count, 1 if self.uncond is None else 2)

    def count_plain(self, *known_counts: int) -> None:
        """Full calls made outside the cache (one context per known count) in the work under reuse."""
        if self.lazy is not None:
            plain = sum(self.plain_work(known) for known in known_counts)
            self.count_work(plain, plain)

    @property
    def head_refresh(self) -> int:
        """Under reuse, a full diffusion-head call every this many reverse steps (0: every call in full)."""
        return 0 if self.settings.reuse is None else self.settings.reuse.head_refresh_every

    def conditions(self, tokens: torch.Tensor, known: torch.Tensor, known_count: int | None = None):
        """The transformer's condition vectors for cond rows, and uncond rows under CFG (one call). ``tokens``
        may hold several contexts per conditioning row (``[k * B, L, C]``, context-major); ``known_count``:
        the tokens every row knows, where the schedule says they know as many (None: they may differ)."""
        repeat = tokens.shape[0] // self.cond.shape[0]
        cond = self.cond.repeat(repeat, 1)
        if self.uncond is None:
            return self.transformer(tokens, known, cond, known_count), None
        both = self.transformer(torch.cat([tokens, tokens]), torch.cat([known, known]),
                                torch.cat([cond, self.uncond.repeat(repeat, 1)]), known_count)
        return both.chunk(2)

    def last_step(self, z_cond, z_uncond, positions, plan: Plan, cfg_scale) -> ReverseStep:
        """The last reverse step's Gaussian for ``positions`` [B, n] from conditions ``[B, L, D]``,
        flattened to ``[B * n, C]``."""
        start, noise = plan.trajectory(positions)
        return self.reverse(at(z_cond, positions), at(z_uncond, positions), cfg_scale, start, noise)

    def reverse(self, z_cond, z_uncond, cfg_scale, start, noise) -> ReverseStep:
        """The head's reverse process for tokens with conditions ``[N, D]`` (``reverse_process``)."""
        return reverse_process(self.model.head, self.diffusion, z_cond, z_uncond, cfg_scale, self.settings.temperature,
                               start, noise, self.head_refresh, self.compile_mode)


def compiled_conditions(model_class: type, mode: str):
    """The transformer call (``conditions``) through torch.compile: without CUDA graphs (its kept-token count, and
    with it its shapes, changes at every step: a graph per count would be recorded), dynamic where calls differ
    (the first count, then one graph for the others: dynamo specialises a count of 0 or 1)."""
    return compiled_function(model_class.conditions, without_graphs(mode), dynamic=None)


def record_work(stats: DecodeStats, *guides: Guide) -> None:
    """Feature reuse's transformer work, per call and over the generation (every guide's calls), into ``stats``."""
    work = [entry for guide in guides for entry in guide.work]
    if work:
        stats.recomputed_share = [done / plain for done, plain in work]
        stats.transformer_work = sum(done for done, _ in work) / sum(plain for _, plain in work)


class Canvas:
    """The tokens fixed so far, which are known, and the target call that fixed each."""

    def __init__(self, model, batch: int):
        """Tokens in the head's precision (fp32 as loaded), whatever the transformer's."""
        num_tokens, channels, device = model.cfg.num_tokens, model.cfg.token_dim, model.device
        self.tokens = torch.zeros(batch, num_tokens, channels, device=device, dtype=model.head.input_proj.weight.dtype)
        self.known = torch.zeros(batch, num_tokens, dtype=torch.bool, device=device)
        self.fixed_at = torch.zeros(batch, num_tokens, dtype=torch.long, device=device)  # read once, at the end

    def fix(self, positions: torch.Tensor, values: torch.Tensor, iteration: int) -> None:
        """Write ``values`` ``[B * n, C]`` at ``positions`` [B, n]."""
        rows = row_index(positions)
        self.tokens[rows, positions] = values.view(*positions.shape, -1).to(self.tokens.dtype)
        self.known[rows, positions] = torch.ones_like(positions, dtype=torch.bool)  # a number here: a copy, a sync
        self.fixed_at[rows, positions] = torch.full_like(positions, iteration)


def at(values: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor | None:
    """``values`` [B, L, D] at ``positions`` [B, n], flattened row by row: ``[B * n, D]`` (None stays None)."""
    return None if values is None else values[row_index(positions), positions].flatten(0, 1)


@torch.no_grad()
def masked_decode(model, conditioning, settings: MaskedSettings, *, generator,
                  on_iteration: Optional[ProgressFn] = None, watch: Optional[Stopwatch] = None,
                  gaussian_last_step: bool = False, schedule: list[int] | None = None):
    """MAR's sampler: tokens ``[B, L, C]`` (in the model's token space) and their DecodeStats.
    ``gaussian_last_step`` keeps the last reverse step's noise (std about 0.006 at 100 steps), which the
    official sampler leaves out: the distribution CSpD is exact against. ``schedule`` replaces MAR's cosine
    schedule (tokens still masked before each step, then 0): CSpD's merged mode is exact against MAR on
    ``cspd.merged_schedule``."""
    watch = watch or Stopwatch(model.device)
    L, B = model.cfg.num_tokens, conditioning.batch
    settings.validate(L)
    plan = Plan.draw(model, settings, B, generator, schedule)
    guide = Guide(model, conditioning, settings)
    name = "ar" if settings.reuse is None else "ar+reuse"  # reuse is relaxed: never shown as lossless
    stats = DecodeStats(decoder=name, grid=tuple(model.grid), batch=B, baseline_forwards=plan.token_steps,
                        baseline=f"plain MAR at {settings.num_iter} steps",
                        settings={"model_kind": model.kind, **asdict(settings)})
    canvas = Canvas(model, B)
    counts, fresh = [], None
    for step in range(plan.num_steps):
        positions = plan.positions(step)
        if positions.shape[1] == 0:
            continue  # a clamped schedule can leave a step nothing to predict: no call needed
        z_cond, z_uncond = guide.step_conditions(canvas.tokens, canvas.known, plan.known_before(step), positions,
                                                 fresh, guide.reuse_full(step, plan.num_steps))
        fresh = positions
        stats.target_forwards += 1
        last = guide.last_step(z_cond, z_uncond, positions, plan, plan.cfg(settings, step))
        sampled = last.mean + last.std * plan.last_noise(positions) if gaussian_last_step else last.mean
        canvas.fix(positions, sampled, stats.target_forwards)
        counts.append(torch.full((B,), positions.shape[1]))
        watch.lap("forward")  # the transformer and the head: the model's own work
        if on_iteration is not None:
            on_iteration(L - plan.masked[step + 1], L, canvas.tokens)
    record_work(stats, guide)
    finish(stats, watch, counts, canvas.fixed_at, L)
    return canvas.tokens, stats
