"""The one verifier every speculative loop shares (Jacobi windows, drafter chains and trees, ZipAR's windows).

A forward feeds the last fixed token and the drafts; its output gives ``p`` for every node (a chain's slot j
predicts position n + j). ``verify_tree`` walks the drafts from the root with the acceptance rule (a chain: left to
right), fixes one more token from the rule's residual where it stops (or a bonus token at a leaf) and
``verify_window`` writes the accepted run into the token buffer. Rows advance independently.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Callable

import torch

from ...model_loaders.shared.protocol import ModelOutput
from .trees import DraftTree, chain
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

    def add(self, k: torch.Tensor, judged: torch.Tensor, rows=None) -> None:
        """One verification: ``k`` drafts accepted of the ``judged`` ones (verify_tree) per tree, of ``rows``
        (default: every row)."""
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


def verify_window(rule, out, p, sampling, q, x, tree: DraftTree, n, buffer: TokenBuffer, iteration, generator):
    """Verify the drafts ``x`` [B, M] of ``tree`` (drawn from ``q`` [B, M, V]) against the target ``p`` [B, M+1, V]
    of its nodes (from model output ``out``), commit the accepted path and the fixed token (stamped with
    ``iteration``). ``generator``: a torch.Generator, or a compiled loop step's draws (drawn_noise.py).

    Returns ``k`` (drafts accepted per row), the accepted ``path`` (verify_tree) and ``count`` (tokens fixed per
    row, never past the end)."""
    N = buffer.num_tokens
    judged = rule.judged_target(out, sampling, p)  # what the rule compares (p itself but for greedy LANTERN)
    k, path, run, count, judged_drafts = verify_tree(rule, judged, p, q, x, tree, N - n, generator)
    buffer.tally.add(k, judged_drafts)
    slots = torch.arange(run.shape[1], device=p.device)
    target = torch.where(slots < count.unsqueeze(1), n.unsqueeze(1) + slots, buffer.scratch)
    buffer.seq.scatter_(1, target, run)
    buffer.fixed_at.scatter_(1, target, torch.zeros_like(target) + iteration)  # an int, or a 0-d tensor
    return k, path, count


@dataclass(eq=False)
class WindowVerifier:
    """What follows a verified forward in every speculative loop, as a loop step's state (loop_step.py: compiled
    where the model's steps are): the window's distributions from its logits, then ``verify_window``."""

    rule: object
    sampling: SamplingSettings
    buffer: TokenBuffer
    watch: object  # the generation's NonFiniteWatch, or None
    tree: DraftTree  # the drafts' shape (a chain, or a static tree; a dynamic tree comes with its drafts)

    def __post_init__(self):
        self.pipeline = Pipeline.of(self.sampling)  # a new slider value reuses the compiled step

    def verify(self, noise, cond, uncond, q, x, n, iteration, tree=None):
        """``p`` [B, M+1, V] from the forward's logits (node m's output: the target of its children), and
        ``verify_window``'s ``k``, ``path`` and ``count``."""
        out = ModelOutput(cond=cond, uncond=uncond)
        p = probabilities(out, self.pipeline, self.watch)
        tree = self.tree if tree is None else tree
        return (p, *verify_window(self.rule, out, p, self.sampling, q, x, tree, n, self.buffer, iteration, noise))


def verify_run(rule, judged, p, q, x, room, generator):
    """``verify_tree`` on a chain of drafts (``x`` [B, L], slot j of ``p`` the target of draft j). Returns ``k``, the
    run [B, L+1] and ``count``, and the drafts judged."""
    k, _, run, count, judged_drafts = verify_tree(rule, judged, p, q, x, chain(x.shape[1], x.device), room, generator)
    return k, run, count, judged_drafts


def verify_tree(rule, judged, p, q, x, tree: DraftTree, room, generator):
    """The verification itself, for any set of draft trees (a chain is one). Node m's output is the target of its
    children: ``p`` [B, M+1, V] (``judged``: what the rule compares); draft node m (``x[:, m-1]``) was proposed
    from ``q[:, m-1]`` (for siblings drawn without replacement: its parent's q without the siblings drawn before
    it). ``room`` [B] is how many tokens a tree may fix (nodes deeper are never accepted: the end of the image, or
    of what a ZipAR row may see).

    Each node tries its children in sibling order, each against the target left by the rejections before it (the
    rule's residual): recursive rejection sampling, exact under the exact rule (SpecInfer, EAGLE). The accepted
    path runs from the root down through accepted children; its last node fixes one more token, from its residual
    when a child was rejected there, else from its own ``p`` (a leaf's bonus token). Returns ``k`` (drafts
    accepted), ``path`` [B, D] (the accepted node at each depth, 0 past ``k``), the run [B, D+1] (the accepted
    drafts, then at slot k the token fixed there), ``count`` = min(k + 1, room) and the drafts judged on the way."""
    B, M = x.shape
    V = p.shape[-1]
    if M == 0:
        fixed = sample(p[:, 0], generator)
        zero = torch.zeros_like(room)
        return zero, x, fixed.unsqueeze(1), torch.minimum(zero + 1, room), zero
    tree = tree.rows(B)
    u = uniform((B, M), generator)  # one per draft node, drawn whether or not it is reached
    target, chosen = judged, torch.full((B, M + 1), -1, dtype=torch.long, device=p.device)
    tried = torch.zeros(B, M + 1, dtype=torch.long, device=p.device)
    for i in range(tree.siblings):
        child = tree.children[..., i]
        draft = (child - 1).clamp(min=0)
        x_child = x.gather(1, draft)
        q_child = q.gather(1, draft.unsqueeze(-1).expand(B, M + 1, V))
        judge = (child > 0) & (chosen < 0) & (tree.depth < room.unsqueeze(1))  # the child's depth is within room
        accept = judge & (u.gather(1, draft) < rule.accept_probability(target, q_child, x_child))
        chosen = torch.where(accept, child, chosen)
        rejected = judge & ~accept
        target = torch.where(rejected.unsqueeze(-1), rule.residual(target, q_child, x_child), target)
        tried = tried + judge.long()
    node = torch.arange(M + 1, device=p.device)
    picked = (chosen.gather(1, tree.parent) == node) | (node == 0)  # each node accepted by its parent
    on_path = ~(tree.ancestors & ~picked.unsqueeze(1)).any(-1)
    depth = torch.where(on_path, tree.depth, -1)
    k, stop = depth.max(-1)  # the path's length and its last node
    D = tree.levels
    path = torch.zeros(B, D + 1, dtype=torch.long, device=p.device)
    path = path.scatter(1, torch.where(on_path & (node > 0), tree.depth - 1, D), node.expand(B, -1))[:, :D]
    at_stop = stop.view(B, 1, 1).expand(B, 1, V)
    residual = tried.gather(1, stop.unsqueeze(1)) > 0
    fixed = sample(torch.where(residual, target.gather(1, at_stop).squeeze(1), p.gather(1, at_stop).squeeze(1)),
                   generator)
    drafts = x.gather(1, (path - 1).clamp(min=0))
    run = torch.cat([drafts, fixed.unsqueeze(1)], dim=1).scatter(1, k.unsqueeze(1), fixed.unsqueeze(1))
    return k, path, run, torch.minimum(k + 1, room), (tried * on_path).sum(-1)
