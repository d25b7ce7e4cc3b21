"""Training-free accelerators of next-scale models, as options of VAR's sampler (and of any next-scale family whose
session offers ``forward_pruned``, model_loaders/shared/protocol.py).

- FastVAR's cached token pruning (Guo et al., 2025): at a few late scales every block's sub-layers (attention,
  FFN; cross-attention where a family has one) run on the tokens that deviate most from their scale's mean,
  chosen afresh from each sub-layer's input; the other tokens take that block's and sub-layer's output at the
  cache scale (the scale just before the first pruned one), area-interpolated to the current size. Only the
  tokens that ran leave keys and values in the cache. Blocks near the input and the output run in full.
- Step skipping (FastVAR's last scales; SkipVAR's fixed "skip N"): the last scales never run and add nothing to
  the image, which is the VQVAE's f_hat as the last scale that ran left it.
- SkipVAR's unconditional-branch replacement: the last scales run the conditional rows alone and their logits
  stand in for the unconditional ones, so guidance leaves them as they are (and the batch halves).

SkipVAR's sample-adaptive choice between these (a classifier fed frequency features of an intermediate image)
ships as pickled scikit-learn models, which FastAR does not load: its strategies are offered as fixed settings.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from ...errors import FastARError

SUBLAYERS = ("attn", "ffn")  # VAR's; a family with cross-attention names a third ("cross"), counted as it is met


@dataclass(frozen=True)
class ScaleAcceleration:
    """Which scales are pruned, skipped or run without guidance, counted from the end of the schedule."""

    prune_ratios: tuple[float, ...] = ()  # FastVAR: the share of tokens pruned at each of the last scales that run
    skip_last: int = 0  # scales left out at the end (FastVAR: 2; SkipVAR: 0 to 3)
    uncond_last: int = 0  # SkipVAR: the last scales that run without the unconditional branch

    @property
    def active(self) -> bool:
        return bool(self.prune_ratios) or self.skip_last > 0 or self.uncond_last > 0

    def validate(self) -> "ScaleAcceleration":
        for ratio in self.prune_ratios:
            if not 0.0 <= ratio < 1.0:
                raise FastARError(f"a FastVAR prune ratio is the share of a scale's tokens left out: {ratio} is not "
                                  "in [0, 1) (the release prunes 0.4 and 0.5)")
        for name, value in (("skip-scales", self.skip_last), ("uncond-scales", self.uncond_last)):
            if int(value) != value or value < 0:
                raise FastARError(f"--{name} {value}: give a count of scales, 0 or more")
        return self

    def check(self, scales: int) -> None:
        """Raise a FastARError unless this fits a schedule of ``scales`` scales."""
        runs = scales - self.skip_last
        if runs < 1:
            raise FastARError(f"--skip-scales {self.skip_last} leaves none of the model's {scales} scales to run")
        if self.prune_ratios and len(self.prune_ratios) >= runs:
            raise FastARError(f"FastVAR prunes the last {len(self.prune_ratios)} scales that run and restores them "
                              f"from the one before: {runs} of {scales} run here; give fewer ratios or skip less")
        if self.uncond_last > runs:
            raise FastARError(f"--uncond-scales {self.uncond_last}: only {runs} of the model's {scales} scales run")

    def plan(self, scales: int, depth: int) -> "ScalePlan":
        self.check(scales)
        runs = scales - self.skip_last
        first = runs - len(self.prune_ratios)
        ratios = {first + i: r for i, r in enumerate(self.prune_ratios)}
        return ScalePlan(runs=runs, ratios=ratios, cache_scale=first - 1 if ratios else None,
                         blocks=pruned_blocks(depth), cond_only_from=runs - self.uncond_last)


FASTVAR = ScaleAcceleration(prune_ratios=(0.4, 0.5), skip_last=2)  # the release's Infinity schedule, from the end


def pruned_blocks(depth: int) -> range:
    """The blocks that prune: the release prunes 3..27 of Infinity-2B's 32 (the first 3 and the last 4 run in
    full); the same shares of another depth, rounded."""
    return range(round(3 * depth / 32), depth - round(4 * depth / 32))


@dataclass(frozen=True)
class ScalePlan:
    runs: int  # scales that run
    ratios: dict  # scale -> prune ratio
    cache_scale: Optional[int]  # whose sub-layer outputs restore the pruned tokens
    blocks: range  # the blocks that prune
    cond_only_from: int  # the first scale without the unconditional branch (runs: none)


def pivotal_tokens(x: torch.Tensor, keep: int) -> torch.Tensor:
    """``[R, keep]``: the tokens of ``x`` ``[R, n, C]`` farthest (squared L2) from their row's mean token, farthest
    first: FastVAR's proxy for the high-frequency tokens a late scale still has to work on."""
    x = x.float()  # ranking half-precision distances would tie many tokens
    deviation = (x - x.mean(dim=1, keepdim=True)).square().sum(dim=-1)
    return deviation.topk(keep, dim=1, sorted=True).indices


def gather_tokens(x: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    return x.gather(1, kept[..., None].expand(-1, -1, x.shape[-1]))


def restore_tokens(out: torch.Tensor, kept: torch.Tensor, cached: torch.Tensor, cached_hw: tuple[int, int],
                   hw: tuple[int, int]) -> torch.Tensor:
    """``[R, h*w, C]``: ``cached`` (``[R, h0*w0, C]``, a sub-layer's output at the cache scale) area-interpolated
    to ``hw``, with the kept tokens' own outputs ``out`` written over it."""
    R, _, C = cached.shape
    grid = cached.reshape(R, *cached_hw, C).permute(0, 3, 1, 2)
    full = F.interpolate(grid.float(), size=hw, mode="area").to(out.dtype).permute(0, 2, 3, 1).reshape(R, -1, C)
    return full.scatter(1, kept[..., None].expand(-1, -1, C), out)


@dataclass
class ScaleWork:
    """What one scale's forward ran: per sub-layer, the token-rows each block forwarded, and the attention's key
    length per block (what the FLOP estimate needs)."""

    tokens: dict = field(default_factory=dict)  # name -> token-rows summed over blocks
    attention: list = field(default_factory=list)  # per block: (query token-rows, keys per row)


class CachedTokenPruning:
    """One generation's ScalePruning (model_loaders/shared/protocol.py): FastVAR's rule at the plan's scales,
    everything else passed through; counts every sub-layer's tokens either way."""

    def __init__(self, plan: ScalePlan, shapes):
        """``shapes``: each scale's (h, w), or its side for square scales (VAR's patch_nums)."""
        self.plan = plan
        self.shapes = [(s, s) if isinstance(s, int) else tuple(s) for s in shapes]
        self.cached: dict = {}  # (block, name) -> that sub-layer's output at the cache scale
        self.keys: dict = {}  # block -> keys cached per row so far
        self.scale, self.work = 0, []

    def at(self, scale: int) -> "CachedTokenPruning":
        self.scale = scale
        self.work.append(ScaleWork())
        return self

    def hw(self, scale: int) -> tuple[int, int]:
        return self.shapes[scale]

    def keep(self, block: int, name: str, x: torch.Tensor) -> Optional[torch.Tensor]:
        ratio = self.plan.ratios.get(self.scale, 0.0)
        kept = None
        if ratio > 0.0 and block in self.plan.blocks:
            n = x.shape[1]
            kept = pivotal_tokens(x, n - int(n * ratio))  # the release rounds the pruned count down
        ran = x.shape[1] if kept is None else kept.shape[1]
        work = self.work[-1]
        work.tokens[name] = work.tokens.get(name, 0) + ran * x.shape[0]
        if name == "attn":
            self.keys[block] = self.keys.get(block, 0) + ran
            work.attention.append((ran * x.shape[0], self.keys[block]))
        return kept

    def take(self, x: torch.Tensor, kept: Optional[torch.Tensor]) -> torch.Tensor:
        return x if kept is None else gather_tokens(x, kept)

    def restore(self, block: int, name: str, out: torch.Tensor, kept: Optional[torch.Tensor]) -> torch.Tensor:
        if kept is not None:
            cache_hw = self.hw(self.plan.cache_scale)
            cached = self.cached[block, name][: out.shape[0]]  # conditional-only scales use the first rows
            out = restore_tokens(out, kept, cached, cache_hw, self.hw(self.scale))
        if self.scale == self.plan.cache_scale:
            self.cached[block, name] = out
        return out


def transformer_flops(tokens: dict, attention: list, dim: int, hidden: int) -> float:
    """Multiply-adds x 2 of a scale's blocks: q, k, v and the output projection, scores and values over the keys,
    a cross-attention's q and output projections, and the FFN, from the token-rows each ran (norms, embeddings, the
    head and a cross-attention's scores over the text left out)."""
    projections = 2 * tokens.get("attn", 0) * 4 * dim * dim + 2 * tokens.get("cross", 0) * 2 * dim * dim
    scores = sum(4 * rows * keys * dim for rows, keys in attention)
    return projections + scores + 2 * tokens.get("ffn", 0) * 2 * dim * hidden


def plain_work(shapes, rows: int, depth: int, names=SUBLAYERS) -> list[ScaleWork]:
    """The work of VAR's plain sampler, scale by scale, counted like an accelerated run's."""
    works, keys = [], 0
    for h, w in shapes:
        keys += h * w
        tokens = {name: h * w * rows * depth for name in names}
        works.append(ScaleWork(tokens, [(h * w * rows, keys)] * depth))
    return works


def report(stats, acceleration: ScaleAcceleration, pruning: CachedTokenPruning, *, rows: int, depth: int, dim: int,
           hidden: int) -> None:
    """Fill ``stats`` with what the acceleration saved: per scale, the share of the plain sampler's transformer
    FLOPs done (``recomputed_share``, 0 for a skipped scale) and over the image (``transformer_work``); the
    tokens each sub-layer forwarded per image row, next to the plain sampler's."""
    names = sorted({name for work in pruning.work for name in work.tokens}) or SUBLAYERS
    plain = plain_work(pruning.shapes, rows, depth, names)
    done = pruning.work + [ScaleWork() for _ in plain[len(pruning.work):]]
    flops = [transformer_flops(w.tokens, w.attention, dim, hidden) for w in done]
    plain_flops = [transformer_flops(w.tokens, w.attention, dim, hidden) for w in plain]
    stats.recomputed_share = [f / p for f, p in zip(flops, plain_flops)]
    stats.transformer_work = sum(flops) / sum(plain_flops)
    per_row = lambda works: [sum(w.tokens.values()) / (rows * depth * len(names)) for w in works]  # noqa: E731
    stats.settings["scale_acceleration"] = {
        **asdict(acceleration), "pruned_blocks": [pruning.plan.blocks.start, pruning.plan.blocks.stop],
        "forwarded_tokens": per_row(done), "plain_tokens": per_row(plain), "flops_share": stats.transformer_work}


class AcceleratedScales:
    """What VAR's sampler asks of an acceleration, one generation: how many scales run, each scale's forward,
    and the stats at the end."""

    def __init__(self, acceleration: ScaleAcceleration, model, session, rows: int):
        if not callable(getattr(session, "forward_pruned", None)):
            raise FastARError(f"FastVAR and SkipVAR act on next-scale models whose blocks take them; this is "
                              f"{getattr(model, 'what', type(model).__name__)}")
        self.acceleration, self.model, self.session, self.rows = acceleration, model, session, rows
        shapes = getattr(model, "scale_shapes", None) or model.cfg.patch_nums  # Infinity's (h, w), VAR's sides
        self.plan = acceleration.validate().plan(len(shapes), len(model.blocks))
        self.pruning = CachedTokenPruning(self.plan, shapes)

    @property
    def runs(self) -> int:
        return self.plan.runs

    def forward(self, scale: int, inputs):
        return self.session.forward_pruned(scale, inputs, self.pruning.at(scale),
                                           cond_only=scale >= self.plan.cond_only_from)

    def report(self, stats) -> None:
        """Stats of the image as made: the skipped scales' tokens were never drawn."""
        drawn = sum(h * w for h, w in self.pruning.shapes[: self.runs])
        stats.tokens, stats.fixed_at = drawn, [row[:drawn] for row in stats.fixed_at]
        cfg = self.model.cfg
        report(stats, self.acceleration, self.pruning, rows=self.rows, depth=cfg.depth,
               dim=cfg.dim, hidden=getattr(cfg, "ffn_hidden", 4 * cfg.dim))


def accelerated(acceleration: Optional[ScaleAcceleration], model, session, rows: int) -> Optional[AcceleratedScales]:
    """The run's AcceleratedScales (``rows``: the model's rows per forward, the unconditional ones included), or
    None for VAR's plain sampler."""
    if acceleration is None or not acceleration.validate().active:
        return None
    return AcceleratedScales(acceleration, model, session, rows)
