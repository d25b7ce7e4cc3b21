"""Plain AR and Jacobi-window speculative decoding (SJD, coupled SJD, GSD) over the token-AR protocol.

Jacobi iteration, per row (rows advance independently):
  feed [last fixed token, L drafts] -> p for every slot -> verify drafts left to right with the
  acceptance rule -> fix the first rejected slot from the rule's residual (or a bonus token from the
  last output when all pass) -> the outputs after it become next drafts (coupling) -> new slots at the
  window's end are initialised -> repeat.
One device-to-host sync per iteration (the rows' progress); everything else stays on the device.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..errors import FastARError
from .acceptance import ExactRule, leading_accepts
from .drafts import DraftSource
from .processing import SamplingSettings, probabilities, sample, uniform
from .stats import DecodeStats, Stopwatch

# called after every iteration with (tokens fixed in the slowest row, tokens per row, token buffer)
ProgressFn = Callable[[int, int, torch.Tensor], None]


def _begin(model, conditioning, sampling: SamplingSettings, width: int, generator, name: str, settings: dict):
    """Prefill and sample token 0; returns the session, its first distribution and the stats."""
    session = model.start(conditioning, cfg=sampling.use_cfg, max_window=width)
    p0 = probabilities(session.first, sampling)[:, 0]
    stats = DecodeStats(decoder=name, grid=tuple(model.grid), batch=conditioning.batch, settings=settings)
    return session, p0, stats


def _finish(stats: DecodeStats, watch: Stopwatch, fixed_counts: list, fixed_at: torch.Tensor, n_tokens: int):
    stats.wall_time_s = watch.elapsed()
    stats.forward_time_s = watch.totals.get("forward", 0.0)
    stats.verify_time_s = watch.totals.get("verify", 0.0)
    stats.accepted_per_iteration = torch.stack(fixed_counts).tolist() if fixed_counts else []
    stats.fixed_at = fixed_at[:, :n_tokens].tolist()


@torch.no_grad()
def ar_decode(model, conditioning, sampling: SamplingSettings, *, generator, on_iteration: Optional[ProgressFn] = None):
    """The baseline: one target forward per token, static cache, batched CFG, no host syncs."""
    watch = Stopwatch()
    session, p0, stats = _begin(model, conditioning, sampling, 1, generator, "ar", {})
    B, N = conditioning.batch, model.grid[0] * model.grid[1]
    seq = torch.empty(B, N, dtype=torch.long, device=model.device)
    seq[:, 0] = sample(p0, generator)
    ones = torch.ones(B, dtype=torch.long, device=model.device)
    for i in range(1, N):
        out = session.forward(seq[:, i - 1 : i], ones * (i - 1))
        seq[:, i] = sample(probabilities(out, sampling)[:, 0], generator)
        stats.target_forwards += 1
        if on_iteration is not None:
            on_iteration(i + 1, N, seq)
    watch.lap("forward")
    fixed_at = torch.arange(N).expand(B, N)
    _finish(stats, watch, [ones] * (N - 1), fixed_at, N)
    return seq, stats


@torch.no_grad()
def jacobi_decode(
    model,
    conditioning,
    sampling: SamplingSettings,
    *,
    generator,
    window: int = 16,
    init: str = "random",
    coupling: str = "independent",
    rule=None,
    name: str = "sjd",
    on_iteration: Optional[ProgressFn] = None,
):
    """Speculative Jacobi decoding. ``window`` = tokens per forward (last fixed token + drafts), so at
    most ``window`` tokens are fixed per iteration. Lossless with the exact rule."""
    rule = rule or ExactRule()
    h, w = model.grid
    N, V, B, dev = h * w, model.vocab_size, conditioning.batch, model.device
    if window < 2:
        raise FastARError(f"Jacobi window {window} is too small: use at least 2 (1 is plain AR)")
    L = min(window - 1, N - 1)  # draft slots
    watch = Stopwatch()
    settings = {"window": window, "init": init, "coupling": coupling, "rule": rule.name}
    session, p0, stats = _begin(model, conditioning, sampling, L + 1, generator, name, settings)
    drafts = DraftSource(init, coupling, batch=B, drafts=L, grid=(h, w), vocab=V, generator=generator)

    # fixed tokens by position, then current drafts, then a scratch column for masked writes
    seq = torch.zeros(B, N + L + 1, dtype=torch.long, device=dev)
    fixed_at = torch.zeros(B, N + L + 1, dtype=torch.long, device=dev)
    scratch = N + L
    seq[:, 0] = sample(p0, generator)
    n = torch.ones(B, dtype=torch.long, device=dev)
    drafts.record(torch.zeros(B, 1, dtype=torch.long, device=dev), p0.unsqueeze(1))
    x, q = drafts.initial(seq, n, torch.zeros_like(n), p0)

    slots = torch.arange(L + 1, device=dev)
    fixed_counts = []
    iteration = 0
    while True:
        iteration += 1
        inputs = torch.cat([seq.gather(1, (n - 1).unsqueeze(1)), x], dim=1)
        p = probabilities(session.forward(inputs, n - 1), sampling)  # slot j predicts position n + j
        stats.target_forwards += 1
        watch.lap("forward")
        positions = n.unsqueeze(1) + slots
        drafts.record(positions, p)

        valid = positions[:, :L] < N
        accepted = (uniform((B, L), generator) < rule.accept_probability(p[:, :L], q, x)) & valid
        k = leading_accepts(accepted)
        all_passed = k == L
        kc = k.clamp(max=L - 1).unsqueeze(1)
        p_k = p.gather(1, k.view(B, 1, 1).expand(B, 1, V)).squeeze(1)
        q_k = q.gather(1, kc.unsqueeze(-1).expand(B, 1, V)).squeeze(1)
        fix_dist = torch.where(all_passed.unsqueeze(1), p_k, rule.residual(p_k, q_k, x.gather(1, kc).squeeze(1)))
        fixed_token = sample(fix_dist, generator)

        # commit the accepted drafts and the fixed token; a row never passes its last token
        count = torch.minimum(k + 1, N - n)
        run = torch.cat([x, fixed_token.unsqueeze(1)], dim=1).scatter(1, k.unsqueeze(1), fixed_token.unsqueeze(1))
        target = torch.where(slots < count.unsqueeze(1), positions, scratch)
        seq.scatter_(1, target, run)
        fixed_at.scatter_(1, target, torch.full_like(target, iteration))
        fixed_counts.append(count)

        # next window: slot i continues old slot k+1+i (refined by the coupling), the rest is fresh
        proposals = drafts.couple(p, x, q, positions)
        source = (k.unsqueeze(1) + 1 + slots[:L]).clamp(max=L)
        carried = (k.unsqueeze(1) + 1 + slots[:L]) <= L
        n = n + count
        x_next = proposals.gather(1, source)
        q_next = p.gather(1, source.unsqueeze(-1).expand(B, L, V))
        seq.scatter_(1, torch.where(carried, n.unsqueeze(1) + slots[:L], scratch), x_next)
        x_new, q_new = drafts.initial(seq, n, carried.sum(1), p[:, L])
        x = torch.where(carried, x_next, x_new)
        q = torch.where(carried.unsqueeze(-1), q_next, q_new)
        watch.lap("verify")

        slowest = int(n.min())  # the one host sync of the iteration
        if on_iteration is not None:
            on_iteration(slowest, N, seq[:, :N])
        if slowest >= N:
            break
    _finish(stats, watch, fixed_counts, fixed_at, N)
    return seq[:, :N].clone(), stats
