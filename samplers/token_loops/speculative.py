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
from .acceptance import ExactRule
from .loop_step import LoopStep
from ..processing import Pipeline, SamplingSettings, current_watch, sample
from ..stats import Stopwatch
from .drafting import TreeSettings
from .trees import DraftTree
from .verifier import ProgressFn, RowProgress, TokenBuffer, WindowVerifier, begin, finish



@torch.no_grad()
def speculative_decode(
    model,
    drafter,
    conditioning,
    sampling: SamplingSettings,
    *,
    generator,
    tree: TreeSettings = TreeSettings(),
    drafts: str = "sampled",
    rule=None,
    name: str = "spec",
    on_iteration: Optional[ProgressFn] = None,
    watch: Optional[Stopwatch] = None,
):
    """Draft-then-verify decoding: ``tree`` says what is drafted per target forward (a chain of gamma drafts fixes at
    most gamma + 1 tokens per forward; a tree at most its depth + 1). Lossless with the exact rule."""
    rule = rule or ExactRule()
    N, B, dev = model.grid[0] * model.grid[1], conditioning.batch, model.device
    watch = watch or Stopwatch(dev)
    settings = {**tree.described(), "drafter": drafter.name, "rule": rule.name}
    if drafts != "sampled" and tree.kind != "dynamic":
        settings["drafts"] = drafts
    shape = tree.shape_of(N, dev)
    M, D = shape.nodes, shape.levels
    session, p0, stats = begin(model, conditioning, sampling, M + 1, name, settings, hidden=drafter.needs_target_hidden)
    if not shape.is_chain and not hasattr(session, "forward_tree"):
        raise FastARError(f"{getattr(model, 'what', 'this model')} cannot verify draft trees: use --tree chain")
    draft_session = drafter.start(conditioning, cfg=sampling.use_cfg, max_window=D + 1, target_session=session,
                                  tree_nodes=0 if shape.is_chain else tree.drafter_nodes(shape))
    grower = tree.grower(shape, draft_session, Pipeline.of(sampling), drafts, session, generator, B)

    buffer = TokenBuffer.empty(B, N, D, dev)
    buffer.seq[:, 0] = sample(p0, generator)
    n = torch.ones(B, dtype=torch.long, device=dev)
    last_out, last_start = session.first, torch.full_like(n, -1)
    iteration = torch.zeros((), dtype=torch.long, device=dev)  # on the device: no copy from the host per iteration
    after_forward = LoopStep(DrafterIteration(rule, sampling, buffer, current_watch(), shape), session, generator)
    rows, fixed_counts, every_row = RowProgress(buffer, on_iteration, dev), [], shape.rows(B)
    while True:
        x, q, own = grower.draft(buffer.seq, n, last_out, last_start)
        drafted = every_row if own is None else own
        stats.drafter_forwards += D
        watch.lap("draft")

        inputs = torch.cat([buffer.seq.gather(1, (n - 1).unsqueeze(1)), x], dim=1)
        keys = session.key_slots(rows.horizon(M + 1))
        if shape.is_chain:
            out = session.forward(inputs, n - 1, keys)
        else:
            out = session.forward_tree(inputs, n - 1, drafted.depth, drafted.ancestors, keys)
        stats.target_forwards += 1
        watch.lap("forward")
        per_row = () if own is None else (own.parent, own.depth, own.children, own.ancestors)
        n_next, count, iteration, k, path = after_forward(out.cond, out.uncond, q, x, n, iteration, *per_row)
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

    def body(self, noise, cond, uncond, q, x, n, iteration, *tree):
        """The rows' progress, the tokens fixed, the iteration's number, and the accepted drafts and path. ``tree``:
        each row's tree (parent, depth, children, ancestors) where it has its own (a dynamic tree)."""
        iteration = iteration + 1
        drafted = DraftTree(*tree, self.tree.levels) if tree else None
        _, k, path, count = self.verify(noise, cond, uncond, q, x, n, iteration, drafted)
        return n + count, count, iteration, k, path
