"""Speculative decoding with a drafter: draft a chain of gamma tokens, verify them in one target forward.

Per iteration and per row (rows advance independently):
  drafter catches up on what was fixed -> gamma drafts, each sampled from the drafter's processed
  distribution q -> one target forward over [last fixed token, drafts] -> the shared verifier
  (exact rule = lossless speculative sampling; LANTERN = relaxed) fixes the accepted run plus one token.
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

from ...model_loaders.shared.protocol import ModelOutput
from .acceptance import ExactRule
from .loop_step import LoopStep
from ..processing import Pipeline, SamplingSettings, current_watch, probabilities, sample
from ..stats import Stopwatch
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
    rule=None,
    name: str = "spec",
    on_iteration: Optional[ProgressFn] = None,
    watch: Optional[Stopwatch] = None,
):
    """Draft-then-verify decoding. ``gamma`` = drafts per target forward; at most gamma + 1 tokens are
    fixed per forward. Lossless with the exact rule."""
    rule = rule or ExactRule()
    N, B, dev = model.grid[0] * model.grid[1], conditioning.batch, model.device
    L = min(gamma, N - 1)
    watch = watch or Stopwatch(dev)
    settings = {"gamma": gamma, "drafter": drafter.name, "rule": rule.name}
    if drafts != "sampled":
        settings["drafts"] = drafts
    session, p0, stats = begin(model, conditioning, sampling, L + 1, name, settings, hidden=drafter.needs_target_hidden)
    draft_session = drafter.start(conditioning, cfg=sampling.use_cfg, max_window=L + 1, target_session=session)

    buffer = TokenBuffer.empty(B, N, L, dev)
    buffer.seq[:, 0] = sample(p0, generator)
    n = torch.ones(B, dtype=torch.long, device=dev)
    last_out, last_start = session.first, torch.full_like(n, -1)
    iteration = torch.zeros((), dtype=torch.long, device=dev)  # on the device: no copy from the host per iteration
    after_forward = LoopStep(WindowVerifier(rule, sampling, buffer, current_watch()), session, generator)
    # the drafter's steps compile when the target's do (compiled.py: compile_like, following_mode), so its picks do
    pick = LoopStep(DraftPick(Pipeline.of(sampling), current_watch(), top=drafts == "top"), session, generator)
    rows, fixed_counts = RowProgress(buffer, on_iteration, dev), []
    while True:
        x, q = draft_chain(draft_session, buffer.seq, n, last_out, last_start, L, pick)
        stats.drafter_forwards += L
        watch.lap("draft")

        inputs = torch.cat([buffer.seq.gather(1, (n - 1).unsqueeze(1)), x], dim=1)
        out = session.forward(inputs, n - 1, session.key_slots(rows.horizon(L + 1)))
        stats.target_forwards += 1
        watch.lap("forward")
        last_out, last_start = out, n - 1
        n, count, iteration = after_forward(out.cond, out.uncond, q, x, n, iteration)
        fixed_counts.append(count)
        watch.lap("verify")

        if rows.done(n):
            break
    finish(stats, watch, fixed_counts, buffer.fixed_at, N, buffer.tally)
    return buffer.tokens().clone(), stats


def draft_chain(draft_session, seq, n, last_out, last_start, length: int, pick: LoopStep):
    """``length`` drafts per row from position n on, each with the distribution it was drawn from (``pick``: a
    ``DraftPick`` loop step)."""
    out = draft_session.catch_up(seq, n, last_out, last_start)
    tokens, dists = [], []
    for i in range(length):
        x, q = pick(out.cond, out.uncond)
        tokens.append(x)
        dists.append(q)
        if i + 1 < length:
            out = draft_session.step(x.unsqueeze(1), n + i)
    return torch.stack(tokens, 1), torch.stack(dists, 1)


@dataclass(eq=False)
class DraftPick:
    """A draft from the drafter's logits and the distribution recorded for it: drawn from the processed q, or
    (``top``) the drafter's most likely code, drawn with certainty. A loop step (loop_step.py)."""

    pipeline: Pipeline
    watch: object  # the generation's NonFiniteWatch, or None
    top: bool

    def body(self, noise, cond, uncond):
        q = probabilities(ModelOutput(cond=cond, uncond=uncond), self.pipeline, self.watch)[:, 0]
        if self.top:
            x = q.argmax(-1)
            return x, torch.nn.functional.one_hot(x, q.shape[-1]).to(q.dtype)
        return sample(q, noise), q
