"""Plain AR and Jacobi-window speculative decoding (SJD, coupled SJD, GSD) over the token-AR protocol.

Jacobi iteration, per row (rows advance independently):
  feed [last fixed token, L drafts] -> p for every slot -> verify drafts left to right with the
  acceptance rule -> fix the first rejected slot from the rule's residual (or a bonus token from the
  last output when all pass) -> the outputs after it become next drafts (coupling) -> new slots at the
  window's end are initialised -> repeat.
One device-to-host read per iteration (the rows' progress, an iteration late on CUDA: verifier.RowProgress)
besides the stopwatch's; everything else stays on the device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ...errors import FastARError
from .acceptance import ExactRule
from .drafts import DraftSource
from .loop_step import LoopStep
from ..processing import SamplingSettings, current_watch, probabilities, sample
from ..stats import Stopwatch
from .proactive import PacIteration, PacSettings, pac_shape
from .trees import chain
from .verifier import ProgressFn, RowProgress, TokenBuffer, WindowVerifier, begin, finish

DrawFn = Callable[[torch.Tensor, int], torch.Tensor]  # (distributions [B, V], position) -> codes [B]


@torch.no_grad()
def ar_decode(model, conditioning, sampling: SamplingSettings, *, generator, on_iteration: Optional[ProgressFn] = None,
              watch: Optional[Stopwatch] = None, draw: Optional[DrawFn] = None, name: str = "ar",
              prefix: Optional[torch.Tensor] = None, stop: Optional[int] = None):
    """The baseline: one target forward per token, static cache, batched CFG, no host syncs. ``draw``
    picks token i from its distribution (default: a multinomial sample from ``generator``). ``prefix``
    [B, s] fixes the first s tokens (read in one forward) and ``stop`` ends the sequence early: DD's hybrid
    lets the teacher fill positions s..stop-1."""
    watch = watch or Stopwatch(model.device)
    draw = draw or (lambda dist, _position: sample(dist, generator))
    fixed = 0 if prefix is None else prefix.shape[1]
    session, p, stats = begin(model, conditioning, sampling, max(fixed, 1), name, {})
    B, N = conditioning.batch, stop or model.grid[0] * model.grid[1]
    seq = torch.empty(B, N, dtype=torch.long, device=model.device)
    ones = torch.ones(B, dtype=torch.long, device=model.device)
    if fixed:
        seq[:, :fixed] = prefix
        p = probabilities(session.forward(prefix, ones * 0, session.key_slots(fixed)), sampling)[:, -1]
        stats.target_forwards += 1
    for i in range(fixed, N):
        if i > fixed:
            p = probabilities(session.forward(seq[:, i - 1 : i], ones * (i - 1), session.key_slots(i)), sampling)[:, 0]
            stats.target_forwards += 1
        seq[:, i] = draw(p, i)
        if on_iteration is not None and i > 0:
            on_iteration(i + 1, N, seq)
    watch.lap("forward")
    fixed_at = (torch.arange(N) - max(fixed - 1, 0)).clamp(min=0).expand(B, N)  # a prefix is given, not fixed
    finish(stats, watch, [ones] * stats.target_forwards, fixed_at, N)
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
    watch: Optional[Stopwatch] = None,
    pac: Optional[PacSettings] = None,
):
    """Speculative Jacobi decoding. ``window`` = tokens per forward (last fixed token + drafts), so at
    most ``window`` tokens are fixed per iteration. ``pac``: SJD-PAC's tree at the window's front (proactive.py; its
    window is ``window``). Lossless with the exact rule."""
    rule = rule or ExactRule()
    h, w = model.grid
    N, V, B, dev = h * w, model.vocab_size, conditioning.batch, model.device
    shape = pac_shape(pac, N, dev) if pac else None
    L = shape.main if pac else min(window - 1, N - 1)  # draft slots (along a tree's main chain)
    tree = shape.tree if pac else chain(L, dev)
    watch = watch or Stopwatch(dev)
    settings = {"window": window, "init": init, "coupling": coupling, "rule": rule.name}
    if pac:
        settings.update(pac_branches=pac.branches, pac_depth=pac.depth)
    session, p0, stats = begin(model, conditioning, sampling, tree.nodes + 1, name, settings)
    if pac and not hasattr(session, "forward_tree"):
        raise FastARError(f"{getattr(model, 'what', 'this model')} cannot verify draft trees: use sjd")
    drafts = DraftSource(init, coupling, batch=B, drafts=L, grid=(h, w), vocab=V, generator=generator)

    buffer = TokenBuffer.empty(B, N, L, dev)
    buffer.seq[:, 0] = sample(p0, generator)
    n = torch.ones(B, dtype=torch.long, device=dev)
    drafts.record(torch.zeros(B, 1, dtype=torch.long, device=dev), p0.unsqueeze(1))
    iteration = torch.zeros((), dtype=torch.long, device=dev)  # on the device: no copy from the host per iteration
    if pac:
        work = PacIteration(rule, sampling, buffer, current_watch(), tree, drafts, shape)
        x, q = work.first_window(buffer.seq, n, p0, generator)
    else:
        work = JacobiIteration(rule, sampling, buffer, current_watch(), tree, drafts)
        x, q = drafts.initial(buffer.seq, n, torch.zeros_like(n), p0)
    after_forward = LoopStep(work, session, generator)
    rows, fixed_counts = RowProgress(buffer, on_iteration, dev), []
    while True:
        inputs = torch.cat([buffer.seq.gather(1, (n - 1).unsqueeze(1)), x], dim=1)
        keys = session.key_slots(rows.horizon(tree.nodes + 1))
        if pac:
            rooted = tree.rows(B)
            out = session.forward_tree(inputs, n - 1, rooted.depth, rooted.ancestors, keys)
        else:
            out = session.forward(inputs, n - 1, keys)
        stats.target_forwards += 1
        watch.lap("forward")
        x, q, n_next, count, iteration, k, path = after_forward(out.cond, out.uncond, x, q, n, iteration)
        if pac:  # the accepted path into its positions' cache slots
            session.keep_path(n - 1, path, k)
        n = n_next
        fixed_counts.append(count)
        watch.lap("verify")

        if rows.done(n):
            break
    finish(stats, watch, fixed_counts, buffer.fixed_at, N, buffer.tally)
    return buffer.tokens().clone(), stats


@dataclass(eq=False)
class JacobiIteration(WindowVerifier):
    """A Jacobi iteration after its forward: verification, then the next window's drafts (slot i continues old
    slot k+1+i, refined by the coupling; the rest are fresh)."""

    drafts: DraftSource

    def body(self, noise, cond, uncond, x, q, n, iteration):
        iteration = iteration + 1
        p, k, path, count = self.verify(noise, cond, uncond, q, x, n, iteration)
        B, L, V = *x.shape, p.shape[-1]
        slots = torch.arange(L + 1, device=p.device)
        positions = n.unsqueeze(1) + slots
        self.drafts.record(positions, p)
        proposals = self.drafts.refine(p, x, q, positions, noise)
        source = (k.unsqueeze(1) + 1 + slots[:L]).clamp(max=L)
        carried = (k.unsqueeze(1) + 1 + slots[:L]) <= L
        n = n + count
        x_next = proposals.gather(1, source)
        q_next = p.gather(1, source.unsqueeze(-1).expand(B, L, V))
        seq = self.buffer.seq
        seq.scatter_(1, torch.where(carried, n.unsqueeze(1) + slots[:L], self.buffer.scratch), x_next)
        x_new, q_new = self.drafts.initial(seq, n, carried.sum(1), p[:, L], noise)
        x = torch.where(carried, x_next, x_new)
        q = torch.where(carried.unsqueeze(-1), q_next, q_new)
        return x, q, n, count, iteration, k, path
