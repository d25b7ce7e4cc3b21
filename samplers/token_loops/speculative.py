"""Speculative decoding with a drafter: draft a chain of gamma tokens, or a tree, verify them in one target forward.

Per iteration and per row (rows advance independently):
  drafter catches up on what was fixed -> drafts, depth by depth, each sampled from the drafter's processed
  distribution q (siblings without replacement) -> one target forward over [last fixed token, drafts] (a tree's
  nodes each see their ancestors) -> the shared verifier (exact rule = lossless speculative sampling; LANTERN =
  relaxed) fixes the accepted path plus one token -> a tree's accepted path moves into its positions' cache slots.
Drafts go through the same processing pipeline as the target, so acceptance ratios compare like with like.

``drafts="top"`` drafts the drafter's most likely code instead, as EAGLE-2 and LANTERN's reference code do: a
deterministic proposal, recorded as a one-hot q, so the exact rule accepts it with probability p(x) (still
lossless) and LANTERN with p(x) + p(A). Under token selection ambiguity that is far below sampled drafts'
1 - TV(p, q): it is the setting the LANTERN paper's acceptance figures are measured in.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ...errors import FastARError
from ...model_loaders.shared.protocol import ModelOutput
from .acceptance import ExactRule
from .loop_step import LoopStep
from ..processing import Pipeline, SamplingSettings, current_watch, probabilities, sample
from ..stats import Stopwatch
from .trees import DraftTree, chain, static_tree
from .verifier import ProgressFn, RowProgress, TokenBuffer, WindowVerifier, begin, finish

DRAFTS = ("sampled", "top")  # how a drafter proposes: a draw from its q, or its most likely code


@torch.no_grad()
def speculative_decode(
    model,
    drafter,
    conditioning,
    sampling: SamplingSettings,
    *,
    generator,
    gamma: int = 4,
    drafts: str = "sampled",
    tree: str = "chain",
    rule=None,
    name: str = "spec",
    on_iteration: Optional[ProgressFn] = None,
    watch: Optional[Stopwatch] = None,
):
    """Draft-then-verify decoding. ``tree``: "chain" drafts ``gamma`` tokens per target forward (at most gamma + 1
    fixed per forward), a static shape's name (trees.STATIC_SHAPES) drafts that tree. Lossless with the exact rule."""
    rule = rule or ExactRule()
    N, B, dev = model.grid[0] * model.grid[1], conditioning.batch, model.device
    shape = chain(min(gamma, N - 1), dev) if tree == "chain" else static_tree(tree, dev)
    M, D = shape.nodes, shape.levels
    watch = watch or Stopwatch(dev)
    settings = {"gamma": gamma, "drafter": drafter.name, "rule": rule.name}
    if tree != "chain":
        settings = {"tree": tree, "drafter": drafter.name, "rule": rule.name}
    if drafts != "sampled":
        settings["drafts"] = drafts
    session, p0, stats = begin(model, conditioning, sampling, M + 1, name, settings, hidden=drafter.needs_target_hidden)
    if not shape.is_chain and not hasattr(session, "forward_tree"):
        raise FastARError(f"{getattr(model, 'what', 'this model')} cannot verify draft trees: use --tree chain")
    draft_session = drafter.start(conditioning, cfg=sampling.use_cfg, max_window=D + 1, target_session=session,
                                  tree_nodes=0 if shape.is_chain else M)
    grower = TreeGrower(shape.rows(B), draft_session)

    buffer = TokenBuffer.empty(B, N, D, dev)
    buffer.seq[:, 0] = sample(p0, generator)
    n = torch.ones(B, dtype=torch.long, device=dev)
    last_out, last_start = session.first, torch.full_like(n, -1)
    iteration = torch.zeros((), dtype=torch.long, device=dev)  # on the device: no copy from the host per iteration
    after_forward = LoopStep(DrafterIteration(rule, sampling, buffer, current_watch(), shape), session, generator)
    # the drafter's steps compile when the target's do (compiled.py: compile_like, following_mode), so its picks do
    pick = LoopStep(DraftPick(Pipeline.of(sampling), current_watch(), drafts == "top", shape.siblings), session,
                    generator)
    rows, fixed_counts = RowProgress(buffer, on_iteration, dev), []
    while True:
        x, q = grower.draft(buffer.seq, n, last_out, last_start, pick)
        stats.drafter_forwards += D
        watch.lap("draft")

        inputs = torch.cat([buffer.seq.gather(1, (n - 1).unsqueeze(1)), x], dim=1)
        keys = session.key_slots(rows.horizon(M + 1))
        if shape.is_chain:
            out = session.forward(inputs, n - 1, keys)
        else:
            out = session.forward_tree(inputs, n - 1, grower.tree.depth, grower.tree.ancestors, keys)
        stats.target_forwards += 1
        watch.lap("forward")
        n_next, count, iteration, k, path = after_forward(out.cond, out.uncond, q, x, n, iteration)
        if not shape.is_chain:  # the accepted path into its positions' slots; the drafter reads its hidden states
            session.keep_path(n - 1, path, k)
            out = out.take(torch.cat([torch.zeros_like(path[:, :1]), path], 1))
        last_out, last_start, n = out, n - 1, n_next
        fixed_counts.append(count)
        watch.lap("verify")

        if rows.done(n):
            break
    finish(stats, watch, fixed_counts, buffer.fixed_at, N, buffer.tally)
    return buffer.tokens().clone(), stats


@dataclass(eq=False)
class DrafterIteration(WindowVerifier):
    """A drafter's iteration after its target forward: verification of its chain or tree. A loop step
    (loop_step.py)."""

    def body(self, noise, cond, uncond, q, x, n, iteration):
        """The rows' progress, the tokens fixed, the iteration's number, and the accepted drafts and path."""
        iteration = iteration + 1
        _, k, path, count = self.verify(noise, cond, uncond, q, x, n, iteration)
        return n + count, count, iteration, k, path


class TreeGrower:
    """Drafts a static tree (a chain is one) depth by depth: the drafter's distribution at every node of a depth
    gives that node's children, drawn in sibling order, then the drafter reads them to draft the next depth."""

    def __init__(self, tree: DraftTree, draft_session):
        self.tree, self.session = tree, draft_session
        self.levels = []
        shape = tree.children[0]
        for depth in range(1, tree.levels + 1):
            parents, kids = tree.nodes_at(depth - 1), tree.nodes_at(depth)
            local = tree.parent[0, kids.start:kids.stop] - parents.start
            rank = (shape[tree.parent[0, kids.start:kids.stop]] == torch.arange(kids.start, kids.stop,
                                                                                device=shape.device)[:, None])
            self.levels.append((parents, kids, local, rank.long().argmax(-1)))

    def draft(self, seq, n, last_out, last_start, pick):
        """Drafts ``x`` [B, M] and the distributions ``q`` [B, M, V] they were drawn from (``pick``: a loop step of
        ``DraftPick``)."""
        tree, xs, qs = self.tree, [], []
        out = self.session.catch_up(seq, n, last_out, last_start)
        for parents, kids, local, rank in self.levels:
            if parents.start > 0:
                x = torch.cat(xs, 1)
                if tree.is_chain:
                    out = self.session.step(x[:, -1:], n + parents.start - 1)
                else:
                    nodes = slice(parents.start, parents.stop)
                    out = self.session.grow(x[:, parents.start - 1:parents.stop - 1], n - 1, tree.depth[:, nodes],
                                            tree.ancestors[:, nodes, :], tree.parent[:, nodes], parents.start)
            codes, dists = pick(out.cond, out.uncond)
            xs.append(codes[:, local, rank])
            qs.append(dists[:, local, rank])
        return torch.cat(xs, 1), torch.cat(qs, 1)


@dataclass(eq=False)
class DraftPick:
    """``siblings`` drafts from the drafter's logits at each node, and the distribution each was drawn from: drawn
    from the processed q without replacement (each from q without the codes drawn before it), or (``top``) the
    drafter's most likely codes, each drawn with certainty. A loop step (loop_step.py)."""

    pipeline: Pipeline
    watch: object  # the generation's NonFiniteWatch, or None
    top: bool
    siblings: int

    def body(self, noise, cond, uncond):
        """Codes [B, P, S] and their distributions [B, P, S, V] for the P nodes fed."""
        q = probabilities(ModelOutput(cond=cond, uncond=uncond), self.pipeline, self.watch)
        if self.top:  # (past the codebook's size, the last code again: rejected before, so never accepted)
            x = q.topk(min(self.siblings, q.shape[-1]), dim=-1).indices
            x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], self.siblings - x.shape[-1])], -1)
            return x, torch.nn.functional.one_hot(x, q.shape[-1]).to(q.dtype)
        codes, dists = [], []
        for sibling in range(self.siblings):
            if sibling:
                q = without_drawn(q, codes[-1], dists[0])
            codes.append(sample(q, noise))
            dists.append(q)
        return torch.stack(codes, -1), torch.stack(dists, -2)


def without_drawn(q, x, original):
    """``q`` without code ``x``, renormalised: the next sibling's distribution. Once every code of the drafter's
    support is drawn, the next siblings are drawn from ``original`` again (any distribution keeps the tree exact, as
    long as the one recorded is the one drawn from)."""
    left = q.scatter(-1, x.unsqueeze(-1), 0.0)
    mass = left.sum(-1, keepdim=True)
    return torch.where(mass > 1e-12, left / mass.clamp_min(1e-12), original)
