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

import math
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from ..errors import FastARError, check_choice
from .stats import DecodeStats, Stopwatch
from .verifier import ProgressFn, finish

CFG_SCHEDULES = ("linear", "constant")


@dataclass
class MaskedSettings:
    """The knobs of MAR's sampler (its paper's defaults: 64 steps, linear CFG, 100 diffusion steps)."""

    num_iter: int = 64
    cfg_scale: float = 1.0
    cfg_schedule: str = "linear"
    temperature: float = 1.0
    diffusion_steps: int = 100

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


@dataclass
class Trajectories:
    """x_T ``[B, L, C]`` and every reverse step's noise ``[S, B, L, C]``, per token position."""

    start: torch.Tensor
    noise: torch.Tensor

    @classmethod
    def draw(cls, generator, batch: int, num_tokens: int, channels: int, steps: int, device) -> "Trajectories":
        start = torch.randn(batch, num_tokens, channels, generator=generator, device=device)
        noise = torch.randn(steps, batch, num_tokens, channels, generator=generator, device=device)
        return cls(start, noise)


def reverse_process(head, diffusion, z_cond, z_uncond, cfg_scale: float, temperature: float,
                    start: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Sample tokens ``[N, C]`` from conditions ``[N, D]`` along the given trajectory (fp32 throughout)."""
    x = start.float()
    z_cond = z_cond.float()
    z_uncond = None if z_uncond is None else z_uncond.float()
    for index in reversed(range(diffusion.num_steps)):
        t = torch.full((x.shape[0],), diffusion.model_timestep(index), device=x.device, dtype=torch.long)
        eps, variance = head.guided(x, t, z_cond, z_uncond, cfg_scale)
        step = diffusion.reverse_step(x, index, eps, variance)
        x = step.mean if index == 0 else step.mean + step.std * noise[index] * temperature
    return x


def step_conditions(model, tokens, known, class_vectors, uncond_vectors):
    """The transformer's condition vectors for cond rows, and for uncond rows under CFG (one call)."""
    if uncond_vectors is None:
        return model.conditions(tokens, known, class_vectors), None
    both = model.conditions(torch.cat([tokens, tokens]), torch.cat([known, known]),
                            torch.cat([class_vectors, uncond_vectors]))
    return both.chunk(2)


@torch.no_grad()
def masked_decode(model, conditioning, settings: MaskedSettings, *, generator,
                  on_iteration: Optional[ProgressFn] = None, watch: Optional[Stopwatch] = None):
    """MAR's sampler: tokens ``[B, L, C]`` (in the model's token space) and their DecodeStats."""
    watch = watch or Stopwatch(model.device)
    L, C, B = model.cfg.num_tokens, model.cfg.token_dim, conditioning.batch
    settings.validate(L)
    diffusion = model.diffusion(settings.diffusion_steps)
    device = model.device
    order = torch.stack([torch.randperm(L, generator=generator, device=device) for _ in range(B)])
    paths = Trajectories.draw(generator, B, L, C, diffusion.num_steps, device)
    cond_vectors = model.class_vectors(conditioning, uncond=False)
    uncond_vectors = model.class_vectors(conditioning, uncond=True) if settings.cfg_scale != 1.0 else None
    stats = DecodeStats(decoder="ar", grid=tuple(model.grid), batch=B,
                        settings={"model_kind": "mar", **asdict(settings)})
    tokens = torch.zeros(B, L, C, device=device)
    known = torch.zeros(B, L, dtype=torch.bool, device=device)
    fixed_at = torch.zeros(B, L, dtype=torch.long)
    counts = []
    masked = mask_schedule(L, settings.num_iter)
    rows = torch.arange(B, device=device).unsqueeze(1)
    for step in range(settings.num_iter):
        chosen = order[:, masked[step + 1]: masked[step]]  # [B, n]: this step's positions
        if chosen.shape[1] == 0:
            continue  # a clamped schedule can leave a step nothing to predict: no call needed
        z_cond, z_uncond = step_conditions(model, tokens, known, cond_vectors, uncond_vectors)
        stats.target_forwards += 1
        pick = (rows, chosen)
        sampled = reverse_process(
            model.head, diffusion, z_cond[pick].flatten(0, 1), None if z_uncond is None else z_uncond[pick].flatten(0, 1),
            cfg_at(settings, L, masked[step + 1]), settings.temperature,
            paths.start[pick].flatten(0, 1), paths.noise[:, rows, chosen].flatten(1, 2))
        tokens[pick] = sampled.view(B, -1, C).to(tokens.dtype)
        known[pick] = True
        fixed_at[pick[0].cpu(), chosen.cpu()] = stats.target_forwards
        counts.append(torch.full((B,), chosen.shape[1]))
        watch.lap("forward")  # the transformer and the head: the model's own work
        if on_iteration is not None:
            on_iteration(L - masked[step + 1], L, tokens)
    finish(stats, watch, counts, fixed_at, L)
    return tokens, stats
