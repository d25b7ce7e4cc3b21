"""The one verifier every speculative loop shares (Jacobi windows and drafter chains).

A window holds the last fixed token and ``L`` drafts; its forward gives ``p`` for every slot (slot j
predicts position n + j). ``verify_window`` runs the acceptance rule over the drafts left to right, fixes
the first rejected slot from the rule's residual (or a bonus token from the last slot when all pass) and
writes the accepted run into the token buffer. Rows advance independently.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Callable

import torch

from ...model_loaders.shared.protocol import ModelOutput
from .acceptance import leading_accepts
from ..processing import Pipeline, SamplingSettings, probabilities, sample, uniform
from ..stats import DecodeStats, Stopwatch

# called after every iteration with (tokens fixed in the slowest row, tokens per row, token buffer)
ProgressFn = Callable[[int, int, torch.Tensor], None]


@dataclass
class TokenBuffer:
    """Fixed tokens by position, then room for drafts, then one scratch column for masked writes."""

    seq: torch.Tensor  # [B, N + L + 1]
    fixed_at: torch.Tensor  # iteration that fixed each token
    num_tokens: int
    tally: "DraftTally"

    @classmethod
    def empty(cls, batch: int, num_tokens: int, drafts: int, device) -> "TokenBuffer":
        seq = torch.zeros(batch, num_tokens + drafts + 1, dtype=torch.long, device=device)
        return cls(seq, torch.zeros_like(seq), num_tokens, DraftTally.empty(batch, device))

    @property
    def scratch(self) -> int:
        return self.seq.shape[1] - 1

    def tokens(self) -> torch.Tensor:
        return self.seq[:, : self.num_tokens]


@dataclass
class DraftTally:
    """Drafts judged and accepted per row, counted on the device (read once, when the generation ends)."""

    judged: torch.Tensor  # [B]
    accepted: torch.Tensor  # [B]

    @classmethod
    def empty(cls, batch: int, device) -> "DraftTally":
        return cls(torch.zeros(batch, dtype=torch.long, device=device), torch.zeros(batch, dtype=torch.long, device=device))

    def add(self, k: torch.Tensor, count: torch.Tensor, drafts: int, rows=None) -> None:
        """One verification of ``drafts`` slots: ``k`` accepted and ``count`` fixed per window (verify_run), of
        ``rows`` (default: every row). The rule judged the drafts up to the first rejected one, and none past
        the window's room: min(count, drafts) of them."""
        judged = torch.clamp(count, max=drafts)
        if rows is None:
            self.judged += judged
            self.accepted += k
        else:  # ZipAR: several windows per row
            self.judged.index_add_(0, rows, judged)
            self.accepted.index_add_(0, rows, k)


def begin(model, conditioning, sampling: SamplingSettings, width: int, name: str, settings: dict, hidden=False):
    """Prefill; returns the session, the distribution of token 0 and fresh stats."""
    extra = {"hidden": True} if hidden else {}  # models without hidden states need not know the flag
    session = model.start(conditioning, cfg=sampling.use_cfg, max_window=width, **extra)
    p0 = probabilities(session.first, sampling)[:, 0]
    tokens = model.grid[0] * model.grid[1]  # plain AR draws token 0 from the prefill, then one per forward
    stats = DecodeStats(decoder=name, grid=tuple(model.grid), batch=conditioning.batch, baseline="plain AR",
                        baseline_forwards=tokens - 1,
                        settings=settings)
    return session, p0, stats


def finish(stats: DecodeStats, watch: Stopwatch, fixed_counts: list, fixed_at: torch.Tensor, n_tokens: int,
           tally: DraftTally | None = None):
    """The generation's statistics, read from the device once: times, the tokens each forward fixed (``fixed_counts``:
    [B] per forward), the forward that fixed each token, and the drafts ``tally`` counted."""
    stats.wall_time_s = watch.elapsed()
    stats.setup_time_s = watch.totals.get("setup", 0.0)
    stats.forward_time_s = watch.totals.get("forward", 0.0)
    stats.verify_time_s = watch.totals.get("verify", 0.0)
    stats.drafter_time_s = watch.totals.get("draft", 0.0)
    counts = torch.stack(fixed_counts) if fixed_counts else fixed_at.new_zeros(0, fixed_at.shape[0])
    if tally is not None:  # read with the counts: one read
        counts = torch.cat([counts, tally.judged[None].to(counts.device), tally.accepted[None].to(counts.device)])
    rows = counts.tolist()
    if tally is not None:
        *rows, judged, accepted = rows
        stats.drafted_tokens, stats.accepted_tokens = sum(judged), sum(accepted)
    stats.fixed_per_forward = rows
    stats.fixed_at = fixed_at[:, :n_tokens].tolist()


LAG_BY_DEVICE = {"cuda": 1}  # iterations RowProgress reads late, by device type (0 elsewhere)


class RowProgress:
    """The one host read of a speculative loop's iteration: report the slowest row; done once every row is. The
    fastest row, read with it, bounds the positions the next forward feeds (``horizon``).

    On CUDA it reads the progress one iteration late: the rows' counts are copied to pinned host memory without
    waiting, and read after the next iteration is queued, by which time the GPU has long finished it. So the host
    queues iteration i + 1 while the GPU runs iteration i (as it does for ``ar``, which never waits), instead of the
    GPU idling while the host turns round after every iteration. The price: one iteration past the end, which
    fixes nothing (no row has room left: its writes go to scratch) but counts as a forward."""

    def __init__(self, buffer: TokenBuffer, on_iteration, device: torch.device):
        self.buffer, self.on_iteration = buffer, on_iteration
        self.lag, self.cuda = LAG_BY_DEVICE.get(device.type, 0), device.type == "cuda"
        self.pending: collections.deque = collections.deque()
        self.fastest = 1  # every row starts with token 0 fixed

    def horizon(self, width: int) -> int:
        """A bound on the positions the next forward of ``width`` tokens feeds (below it), known without waiting:
        a row fixes at most ``width`` tokens per iteration, so none is past the fastest row read plus ``width`` for
        each iteration not read yet, and its window feeds from its last fixed token on."""
        return self.fastest + (len(self.pending) + 1) * width - 1  # pending: the iterations not read yet

    def done(self, n: torch.Tensor) -> bool:
        progress = torch.stack([n.min(), n.max()])
        if self.lag:
            copy = torch.empty(2, dtype=progress.dtype, pin_memory=self.cuda)
            copy.copy_(progress, non_blocking=self.cuda)
            event = torch.cuda.Event() if self.cuda else None
            if event is not None:  # on the stream the copy went to: that of n's GPU, which may not be the current one
                event.record(torch.cuda.current_stream(n.device))
            self.pending.append((copy, event))
            if len(self.pending) <= self.lag:
                return False
            progress, event = self.pending.popleft()
            if event is not None:
                event.synchronize()
        count, self.fastest = progress.tolist()
        if self.on_iteration is not None:
            self.on_iteration(count, self.buffer.num_tokens, self.buffer.tokens())
        return count >= self.buffer.num_tokens


def verify_window(rule, out, p, sampling, q, x, n, buffer: TokenBuffer, iteration, generator):
    """Verify drafts ``x`` [B, L] (drawn from ``q`` [B, L, V]) against the window's target ``p``
    [B, L+1, V] (from model output ``out``), commit the accepted run and the fixed token (stamped with
    ``iteration``). ``generator``: a torch.Generator, or a compiled loop step's draws (drawn_noise.py).

    Returns ``k`` (drafts accepted per row) and ``count`` (tokens fixed per row, never past the end)."""
    L, N = x.shape[1], buffer.num_tokens
    slots = torch.arange(L + 1, device=p.device)
    judged = rule.judged_target(out, sampling, p)  # what the rule compares (p itself but for greedy LANTERN)
    k, run, count = verify_run(rule, judged, p, q, x, N - n, generator)
    buffer.tally.add(k, count, L)
    target = torch.where(slots < count.unsqueeze(1), n.unsqueeze(1) + slots, buffer.scratch)
    buffer.seq.scatter_(1, target, run)
    buffer.fixed_at.scatter_(1, target, torch.zeros_like(target) + iteration)  # an int, or a 0-d tensor
    return k, count


@dataclass(eq=False)
class WindowVerifier:
    """What follows a verified forward in every speculative loop, as a loop step's state (loop_step.py: compiled
    where the model's steps are): the window's distributions from its logits, then ``verify_window``."""

    rule: object
    sampling: SamplingSettings
    buffer: TokenBuffer
    watch: object  # the generation's NonFiniteWatch, or None

    def __post_init__(self):
        self.pipeline = Pipeline.of(self.sampling)  # a new slider value reuses the compiled step

    def verify(self, noise, cond, uncond, q, x, n, iteration):
        """``p`` [B, L+1, V] from the window's logits, and ``verify_window``'s ``k`` and ``count``."""
        out = ModelOutput(cond=cond, uncond=uncond)
        p = probabilities(out, self.pipeline, self.watch)  # slot j predicts position n + j
        return (p, *verify_window(self.rule, out, p, self.sampling, q, x, n, self.buffer, iteration, noise))

    def body(self, noise, cond, uncond, q, x, n, iteration):
        """A drafter chain's iteration after its forward: returns the rows' progress, the tokens fixed and the
        iteration's number."""
        iteration = iteration + 1
        _, _, count = self.verify(noise, cond, uncond, q, x, n, iteration)
        return n + count, count, iteration


def verify_run(rule, judged, p, q, x, room, generator):
    """The verification itself, for any set of windows: slot j of ``p`` [B, L+1, V] (``judged``: what the rule
    compares) is the target of draft ``x[:, j]``; ``room`` [B] is how many tokens a window may fix (drafts past it
    are never accepted: the end of the image, or of what a ZipAR row may see). Returns ``k`` (drafts accepted),
    the run [B, L+1] (the accepted drafts, then at slot k the token fixed there: from the rule's residual at a
    rejection, from ``p`` when every draft passed) and ``count`` = min(k + 1, room), the tokens it fixes."""
    B, L = x.shape
    V = p.shape[-1]
    slots = torch.arange(L, device=p.device)
    accepted = (uniform((B, L), generator) < rule.accept_probability(judged[:, :L], q, x)) & (slots < room.unsqueeze(1))
    k = leading_accepts(accepted)
    at_k = k.view(B, 1, 1).expand(B, 1, V)
    fix_dist = p.gather(1, at_k).squeeze(1)
    if L:
        kc = k.clamp(max=L - 1).unsqueeze(1)
        residual = rule.residual(judged.gather(1, at_k).squeeze(1), q.gather(1, kc.unsqueeze(-1).expand(B, 1, V)).squeeze(1),
                                 x.gather(1, kc).squeeze(1))
        fix_dist = torch.where((k == L).unsqueeze(1), fix_dist, residual)
    fixed_token = sample(fix_dist, generator)
    run = torch.cat([x, fixed_token.unsqueeze(1)], dim=1).scatter(1, k.unsqueeze(1), fixed_token.unsqueeze(1))
    return k, run, torch.minimum(k + 1, room)
