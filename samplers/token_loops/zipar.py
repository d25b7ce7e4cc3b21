"""ZipAR: spatially parallel decoding of token models (He et al., ICML 2025), alone or with Jacobi drafts per row.

Raster AR fixes one token per forward. ZipAR, as its reference code (ThisisBillhe/ZipAR) runs it: the first row
is sampled as usual, the second starts once the first is complete, and every later row starts once the row above
has ``lead`` tokens (the reference's window), so from then on each forward extends every running row by one
token: 2w - 1 + (h - 2) * lead forwards instead of h * w - 1 (16 x 16 at lead 4: 87 instead of 255).

What it samples (a relaxation, unlike SJD): token (r, c) is drawn from the model's distribution given its *ZipAR
context* K(r, c), the tokens before it in raster order that plain ZipAR has fixed when it draws (r, c): the
first row, the earlier tokens of row r, and in each row r' >= 1 above, the columns c' < c + (r - r') * lead. The
rest of the raster prefix (the unfinished ends of the rows above) is masked out of its attention. ``attention=
"reference"`` runs it as the reference code does instead: every earlier slot attended, the unfinished ones as the
zeros the cache holds there, and the stand-in left in its slot until the real token replaces it (its greedy codes
and schedule are the official sampler's: tests/conformance). ``lead`` >= the width hides nothing: plain AR. A row's first token is predicted from a stand-in in the last slot of the row above, as the reference
feeds: the newest token of the row two above (models with row-end tokens feed their row end, which is known).

``window`` > 1 adds Jacobi drafts inside each row: a row's window [last fixed token, drafts...] is verified by the
shared verifier against p(. | K), never reaching a token whose context is not yet fixed. With the exact rule this
samples exactly plain ZipAR's distribution (tests/test_zipar.py), in as many forwards or fewer.

One host sync per iteration: the rows' progress, which plans the next forward's feeds (sent back in one
asynchronous copy).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ...errors import FastARError, check_choice
from ...model_loaders.shared.compiled import runs_compiled
from .acceptance import ExactRule
from .drafts import DraftSource
from ..processing import SamplingSettings, probabilities, sample
from ..stats import Stopwatch
from .verifier import DraftTally, ProgressFn, begin, finish, verify_run


def fixing_time(rows: torch.Tensor, cols: torch.Tensor, width: int, lead: int) -> torch.Tensor:
    """The iteration at which plain ZipAR fixes token (row, col) (iteration 0: the prefill's first token): the
    first row one token per iteration, the second after it, each later one ``lead`` iterations after the row
    above. A column may equal the width: one after the row's last token."""
    return torch.where(rows == 0, cols, width + (rows - 1) * min(lead, width) + cols)


def zipar_context(rows: torch.Tensor, cols: torch.Tensor, grid: tuple[int, int], lead: int) -> torch.Tensor:
    """K(r, c) as a mask ``[..., N]`` over image positions, for targets at ``rows``, ``cols`` [...]: the positions
    before it in raster order that plain ZipAR fixes before it. A column may equal the width: the whole row, what
    the feed of a row's last token sees."""
    h, w = grid
    key = torch.arange(h * w, device=rows.device)
    r, c = rows.unsqueeze(-1), cols.unsqueeze(-1)
    earlier = fixing_time(key // w, key % w, w, lead) < fixing_time(r, c, w, lead)
    return earlier & (key < r * w + c)


ATTENTIONS = ("masked", "reference")


def raster_context(positions: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The reference code's view ``[..., N]``: every slot up to the fed position's own, whatever it holds."""
    return torch.arange(num_tokens, device=positions.device) <= positions.unsqueeze(-1)


def zipar_feeds(grid: tuple[int, int], lead: int, window: int) -> int:
    """A bound on one forward's feeds: the rows that can be running at once (each at least ``lead`` behind the one
    above), each with its window, and as many finished rows' flushes."""
    h, w = grid
    rows = min(h, -(-w // min(lead, w)) + 1)
    return rows * (window + 1)


def feed_bucket(count: int, bound: int) -> int:
    """The feeds a compiled forward is given for ``count``: the next power of two (at least 2), at most ``bound``
    (the most a forward can have), so a generation meets a few shapes, each compiled (and on CUDA recorded as a
    graph) once. The extra feeds repeat a row's last one: the same write, an output nobody reads."""
    return min(bound, max(2, 1 << (count - 1).bit_length()))


@dataclass
class _Feeds:
    """One forward's feeds, planned on the host: per batch row, M feeds (padded by repeating one)."""

    table: np.ndarray  # [B, M, 4]: per feed the image row and column of the token it predicts (column w: none,
    # the feed only writes the row's last token to the cache), where the fed token comes from (a raster position,
    # or -j for the row's draft j-1), and whether it starts a row
    streams: np.ndarray  # [S, 5]: (b, image row, first target column, window width, index of the first feed)


def upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on the device without the host waiting for it: from pinned memory, asynchronously (torch's
    pinned-memory cache keeps the block until the copy is done). On a CPU the array itself."""
    host = torch.from_numpy(array)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


class ZiparPlan:
    """The rows' progress (host copy) and what the next forward feeds: each active row's window, and the last
    token of rows that finished (its cache entry, which the rows below will see)."""

    def __init__(self, batch: int, grid: tuple[int, int], lead: int, window: int):
        self.h, self.w = grid
        self.lead, self.window = min(lead, self.w), window
        self.fixed = np.zeros((batch, self.h), dtype=np.int64)  # tokens fixed per image row
        self.flushed = np.zeros((batch, self.h), dtype=bool)  # a finished row's last token is in the cache

    def room(self, b: int, r: int) -> int:
        """How many tokens row r may fix now: the window, the row's end, and what the row above has fixed (all of
        it for the second row, ``lead`` tokens past the last one drawn for the others)."""
        c = self.fixed[b, r]
        if c == self.w:
            return 0
        room = min(self.window, self.w - c)
        if r > 0 and self.fixed[b, r - 1] < self.w:
            room = 0 if r == 1 else min(room, self.fixed[b, r - 1] - self.lead - c + 1)
        return max(room, 0)

    def row_start_source(self, r: int) -> int:
        """The token fed to predict row r's first token, in the last slot of row r - 1: that token itself where
        K(r, 0) holds it (the second row, or a lead of the whole width), else the reference's stand-in, the newest
        token of row r - 2 that K(r, 0) holds."""
        if r == 1 or self.lead == self.w:
            return r * self.w - 1
        newest = self.w if r == 2 else min(self.w, 2 * self.lead)  # row r - 2's tokens in K(r, 0)
        return (r - 2) * self.w + newest - 1

    def done(self) -> bool:
        return bool((self.fixed == self.w).all())

    def feeds(self, bound: int | None = None) -> _Feeds:
        """The next forward's feeds; ``bound`` (a compiled forward's: ``zipar_feeds``) pads their count to a bucket."""
        rows, streams = [], []
        for b in range(self.fixed.shape[0]):
            feeds = []  # (target row, target column, token source, row start)
            for r in range(self.h):
                c, room = self.fixed[b, r], self.room(b, r)
                if room:
                    streams.append((b, r, c, room, len(feeds)))
                    source = self.row_start_source(r) if c == 0 else r * self.w + c - 1
                    feeds.append((r, c, source, c == 0))
                    feeds += [(r, c + j, -j, False) for j in range(1, room)]  # -j: the row's draft j - 1
                elif c == self.w and not self.flushed[b, r]:
                    feeds.append((r, self.w, r * self.w + self.w - 1, False))
                    self.flushed[b, r] = True
            if not feeds:  # a finished image: repeat the flush of its last token (the same write, harmless)
                feeds.append((self.h - 1, self.w, self.h * self.w - 1, False))
            rows.append(feeds)
        M = max(len(f) for f in rows)
        M = M if bound is None else feed_bucket(M, bound)
        padded = [f + [f[-1]] * (M - len(f)) for f in rows]
        return _Feeds(np.array(padded, dtype=np.int64), np.array(streams, dtype=np.int64).reshape(-1, 5))



@torch.no_grad()
def zipar_decode(model, conditioning, sampling: SamplingSettings, *, generator, lead: int = 4, window: int = 1,
                 rule=None, coupling: str = "independent", attention: str = "masked", name: str = "zipar",
                 on_iteration: Optional[ProgressFn] = None, watch: Optional[Stopwatch] = None):
    """ZipAR (``window`` 1) or ZipAR with Jacobi drafts in each row (``window`` > 1: last fixed token + drafts);
    drafts start random and carry the last forward's samples (``coupling``). ``attention``: "masked" (K(r, c)) or
    "reference" (the reference code's zero-filled view; plain ZipAR only). Returns (tokens [B, N], stats)."""
    if lead < 1:
        raise FastARError(f"ZipAR lead {lead} is too small: a row starts once the row above has at least 1 token")
    check_choice("ZipAR attention", attention, ATTENTIONS)
    if attention == "reference" and window > 1:
        raise FastARError("ZipAR's reference attention sees unfinished slots, where drafts would leave stale "
                          "values: use it with plain zipar, or the masked attention with zipar-sjd")
    rule = rule or ExactRule()
    (h, w), V, B, dev = model.grid, model.vocab_size, conditioning.batch, model.device
    N, L = h * w, window - 1
    plan = ZiparPlan(B, (h, w), lead, window)
    watch = watch or Stopwatch(dev)
    settings = {"lead": plan.lead, "window": window, "rule": rule.name, "attention": attention}
    bound = zipar_feeds((h, w), lead, window)
    session, p0, stats = begin(model, conditioning, sampling, bound, name, settings)
    if not hasattr(session, "forward_at"):
        raise FastARError(f"ZipAR needs a model whose attention can hide positions; {getattr(model, 'what', 'this model')} "
                          "cannot: use sjd, gsd or lantern with it")
    bucket = bound if runs_compiled(session.forward_at) else None
    seq = torch.zeros(B, N + 1, dtype=torch.long, device=dev)  # one spare column: targets past a row's end
    fixed_at = torch.zeros(B, N + 1, dtype=torch.long, device=dev)
    tally = DraftTally.empty(B, dev)
    seq[:, 0] = sample(p0, generator)
    plan.fixed[:, 0] = 1
    drafts = torch.zeros(B, h, L, dtype=torch.long, device=dev)  # each row's carried drafts and their q
    q_drafts = torch.full((B, h, L, V), 1.0 / V, device=dev)
    carried = torch.zeros(B, h, dtype=torch.long, device=dev)
    coupler = DraftSource("random", coupling, batch=B, drafts=L, grid=(h, w), vocab=V, generator=generator) if L else None
    batch_index = torch.arange(B, device=dev)[:, None]
    fixed_counts, iteration = [], 0
    while not plan.done():
        iteration += 1
        feeds = plan.feeds(bucket)
        split = feeds.table.size  # one copy to the device per forward (each copy of host data syncs on a GPU)
        packed = upload(np.concatenate([feeds.table.ravel(), feeds.streams.ravel()]), dev)
        row, col, source, row_start = packed[:split].view(feeds.table.shape).unbind(-1)
        row_start = row_start.bool()
        tokens = seq.gather(1, source.clamp(min=0))
        if L:
            # fresh draft slots: random codes, uniform q (carried ones keep the last forward's sample and its p)
            fresh = torch.arange(L, device=dev) >= carried.unsqueeze(-1)
            drafts = torch.where(fresh, torch.randint(V, drafts.shape, generator=generator, device=dev), drafts)
            q_drafts = torch.where(fresh.unsqueeze(-1), 1.0 / V, q_drafts)
            tokens = torch.where(source < 0, drafts[batch_index, row, (-source - 1).clamp(min=0)], tokens)
        visible = zipar_context(row, col, (h, w), plan.lead) if attention == "masked" else \
            raster_context(row * w + col - 1, N)
        out = session.forward_at(tokens, row * w + col - 1, visible, row_start)
        p = probabilities(out, sampling)  # feed m's target distribution
        stats.target_forwards += 1
        watch.lap("forward")

        sb, sr, sc, room, first = packed[split:].view(-1, 5).unbind(1)
        slots = torch.arange(L + 1, device=dev)
        at = (first.unsqueeze(1) + slots.clamp(max=room.unsqueeze(1) - 1))  # past the room: any slot of the window
        p_stream = p[sb.unsqueeze(1), at]  # [S, L+1, V]
        x, q = drafts[sb, sr], q_drafts[sb, sr]
        k, run, count, judged = verify_run(rule, rule.judged_target(None, sampling, p_stream), p_stream, q, x, room,
                                           generator)
        tally.add(k, judged, rows=sb)
        positions = (sr * w + sc).unsqueeze(1) + slots
        write = torch.where(slots < count.unsqueeze(1), positions, N)
        seq[sb.unsqueeze(1), write] = run
        fixed_at[sb.unsqueeze(1), write] = torch.full_like(write, iteration)
        if L:  # the window's later outputs become the next drafts of the row
            proposals = coupler.refine(p_stream, x, q, positions)
            keep = (count.unsqueeze(1) + slots[:L]).clamp(max=L)
            drafts[sb, sr] = proposals.gather(1, keep)
            q_drafts[sb, sr] = p_stream.gather(1, keep.unsqueeze(-1).expand(-1, -1, V))
            carried[sb, sr] = (room - count).clamp(min=0)
        per_row = torch.zeros(B, h, dtype=torch.long, device=dev).index_put_((sb, sr), count)
        fixed_counts.append(per_row.sum(1))
        plan.fixed += np.array(per_row.tolist())  # the iteration's one host sync
        watch.lap("verify")
        if on_iteration is not None:
            on_iteration(int(plan.fixed.sum(1).min()), N, seq[:, :N])
    finish(stats, watch, fixed_counts, fixed_at, N, tally)
    return seq[:, :N].clone(), stats
