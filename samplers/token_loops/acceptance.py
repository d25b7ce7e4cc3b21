"""Acceptance rules: small pure functions over (target p, draft q, draft tokens x).

A rule gives, for every window slot, the probability of accepting the draft, and the distribution to
resample from at the first rejection. Decoding loops take a rule as a parameter, so any rule runs on
any draft source.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ...errors import check_choice
from ..processing import probabilities
from .table_cache import cached_table

_TINY = 1e-12
PROB_FILTERS = ("relative", "absolute")  # GSD's probability-closeness filters


def at(dist: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``dist[..., tokens]``: probability of each token under its own distribution."""
    return dist.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def positive_residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm([p - q]_+)``; falls back to ``p`` where p == q (a rejection there has probability 0)."""
    residual = (p - q).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > _TINY, residual / mass.clamp_min(_TINY), p)


class ExactRule:
    """Speculative sampling: accept x with min(1, p(x)/q(x)); lossless."""

    name = "exact"

    def judged_target(self, out, sampling, p):
        """The target distributions this rule compares drafts against: the processed ``p``."""
        return p

    def accept_probability(self, p, q, x):
        return (at(p, x) / at(q, x).clamp_min(_TINY)).clamp(max=1.0)

    def residual(self, p, q, x):
        return positive_residual(p, q)


ENTROPY_FLOOR = 0.05  # the reference's offset: even a one-hot target keeps 1/20 of the uniform draw


@dataclass
class EntropyRule(ExactRule):
    """Entropy-aware acceptance (Ma et al., arXiv 2510.09012): the uniform draw that decides a draft is shrunk where
    the target is confident, so x is accepted with min(1, p(x) / (s q(x))), s = clamp(H(p) / ln V + 0.05, 0, 1), H in
    nats over the processed target and V the codebook's size (the reference divides by 9 on Lumina-mGPT's 8192
    codes, ln 8192 = 9.01). ``strength`` in [0, 1] blends s toward 1: 0 is exact speculative sampling, 1 the
    reference's rule. The residual stays the exact rule's, as in the reference, so the output leans toward the
    drafts. Relaxed: trades fidelity for speed; greedy drafts are decided as by the exact rule (p is one-hot)."""

    strength: float = 1.0
    name = "entropy"

    def accept_probability(self, p, q, x):
        entropy = -(p * p.clamp_min(_TINY).log()).sum(-1)
        scale = (entropy / math.log(p.shape[-1]) + ENTROPY_FLOOR).clamp(0.0, 1.0)
        scale = 1.0 - self.strength * (1.0 - scale)
        return (at(p, x) / (scale * at(q, x)).clamp_min(_TINY)).clamp(max=1.0)


@dataclass
class GroupedRule(ExactRule):
    """GSD: accept x when its dynamic cluster's target mass covers its draft mass.

    The cluster is the 2 * (group // 2) + 1 codes whose rank under p is within ``group // 2`` of x's rank
    (so an even G and G + 1 give the same cluster), minus the codes whose probability is not close to
    p(x) or that lie farther from x than ``distance_threshold``. Codes outside the target's support (cut
    by top-k/top-p) are never accepted.
    Probability closeness (``prob_filter``): "absolute" is the paper's |p(c) - p(x)| <= prob_threshold,
    tuned on flat distributions (a confident model leaves no member within 0.15 of a likely draft);
    "relative" is |p(c) - p(x)| <= prob_threshold * max(p(c), p(x)), which means the same at every scale.
    Distance is rank-based, so one threshold means the same on every model: D(x, c) is the fraction of
    codes nearer to x than c is (0.5 keeps the nearer half). Raw L2 distances in a wide embedding table
    all sit close to their mean, where any absolute or mean-scaled threshold keeps everything or nothing.
    ``group=1`` is exactly SJD. Relaxed: trades fidelity for speed. The residual is the exact rule's.
    """

    group: int
    embeddings: torch.Tensor  # [V, D]
    prob_threshold: float = 0.15
    distance_threshold: float = 0.5
    prob_filter: str = "absolute"
    name = "grouped"

    def __post_init__(self):  # the settings' ranges: DecoderSpec.validate()
        check_choice("GSD probability filter", self.prob_filter, PROB_FILTERS)
        self.embeddings = self.embeddings.detach().float()
        self.radius = neighbourhood_radius(self.embeddings, self.distance_threshold)

    def accept_probability(self, p, q, x):
        half = self.group // 2
        if half == 0:
            return super().accept_probability(p, q, x)
        members, in_range = rank_neighbours(p, x, half)
        p_members, q_members = p.gather(-1, members), q.gather(-1, members)
        p_x = at(p, x).unsqueeze(-1)
        scale = torch.maximum(p_members, p_x) if self.prob_filter == "relative" else 1.0
        close_prob = (p_members - p_x).abs() <= self.prob_threshold * scale
        close_code = squared_distances(self.embeddings, members, x) <= self.radius[x].unsqueeze(-1)
        keep = in_range & close_prob & close_code
        p_group = (p_members * keep).sum(-1)
        q_group = (q_members * keep).sum(-1)
        ratio = (p_group / q_group.clamp_min(_TINY)).clamp(max=1.0)
        # a code that top-k/top-p removed from the target is never accepted, whatever its group
        return torch.where(at(p, x) > 0, ratio, torch.zeros_like(ratio))


DISTANCE_CHUNK = 1 << 25  # gathered embedding values at once (128 MB in fp32)


def squared_distances(e: torch.Tensor, members: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``|e[members] - e[x]|^2`` ``[..., M]``, a few drafts at a time: all at once, a window of 1000-code groups
    at a 7B model's width gathers gigabytes."""
    flat_members, flat_x = members.reshape(-1, members.shape[-1]), x.reshape(-1)
    rows = max(1, DISTANCE_CHUNK // (members.shape[-1] * e.shape[-1]))
    parts = [(e[flat_members[i:i + rows]] - e[flat_x[i:i + rows]].unsqueeze(-2)).pow(2).sum(-1)
             for i in range(0, flat_x.shape[0], rows)]
    return torch.cat(parts).view(members.shape)


def rank_neighbours(p, x, half: int):
    """x and the ``half`` codes ranked just above it and just below it by p ([..., 2 * half + 1] codes), and
    which of them exist (x near the top or the bottom has fewer). Two top-k selections instead of sorting
    the codebook: a sort of 16384 codes per draft was a third of GSD's time on a CPU."""
    p_x = at(p, x).unsqueeze(-1)
    k = min(half, p.shape[-1])
    nothing = float("-inf")  # a Python number: a tensor made here would be a host-to-device copy per window
    above = torch.topk(torch.where(p > p_x, -p, nothing), k, dim=-1)  # the least likely of the likelier codes
    below = torch.topk(torch.where(p < p_x, p, nothing), k, dim=-1)  # the likeliest of the less likely codes
    members = torch.cat([above.indices.flip(-1), x.unsqueeze(-1), below.indices], dim=-1)
    exists = torch.cat([above.values.flip(-1) > nothing, torch.ones_like(p_x, dtype=torch.bool),
                        below.values > nothing], dim=-1)
    return members, exists


def without_a(p, members, mass, in_a):
    """The target with the mass of LANTERN's set A removed."""
    return p.scatter(-1, members, torch.where(in_a, 0.0, mass))


def neighbourhood_radius(embeddings: torch.Tensor, fraction: float) -> torch.Tensor:
    """Per code, the squared L2 radius holding ``fraction`` of all codes, on the table's device; computed
    once per table (seconds for a 16384-code table)."""
    return cached_table("gsd_radius", embeddings, (float(fraction),), lambda e: _radius(e, fraction))


def _radius(embeddings: torch.Tensor, fraction: float, reference: int = 2048, chunk: int = 1024):
    """Estimated against a fixed sample of ``reference`` codes (exact when the table is smaller)."""
    V = embeddings.shape[0]
    if fraction >= 1.0:
        return torch.full((V,), float("inf"), device=embeddings.device)
    sample = torch.randperm(V, generator=torch.Generator().manual_seed(0))[:reference]
    ref = embeddings[sample.to(embeddings.device)]
    k = max(1, math.ceil(fraction * ref.shape[0]))
    radii = [torch.cdist(part, ref).pow(2).kthvalue(k, dim=-1).values for part in embeddings.split(chunk)]
    return torch.cat(radii)


@dataclass
class LanternRule(ExactRule):
    """LANTERN: accept x with min(1, (p(x) + p(A)) / q(x)), where A is x's latent neighbourhood
    trimmed to a total-variation budget.

    ``neighbours`` [V, k] lists, for every code, the k nearest codes in the VQ latent space (itself
    first). A_{k,delta}(x) is the longest run of x's neighbours, nearest first, whose target mass stays
    below ``delta``: moving that mass onto x changes the target by exactly that much in TV. On rejection
    the token comes from norm([p_A - q]_+), p_A being the distorted target (A's mass moved onto x).
    ``delta=0`` is exact speculative sampling. ``lam`` >= 1 bounds A multiplicatively instead (LANTERN++): the
    longest run whose mass stays within (lam - 1) p(x), so x's relaxed probability is at most lam p(x); ``lam=1`` is
    exact. Greedy (temperature 0): accept iff x is the argmax of p_A computed from the untempered target. A code outside the target's support (top-k/top-p) gets an empty A,
    so it is never accepted nor drawn from the residual. Relaxed: trades fidelity for speed.
    """

    neighbours: torch.Tensor  # [V, k] int, column 0 = the code itself
    delta: float = 0.1
    greedy: bool = False
    lam: float = 0.0  # > 0: LANTERN++'s multiplicative bound, in place of delta
    name = "lantern"

    def __post_init__(self):
        if self.lam:
            self.name = f"lantern++ (lambda {self.lam:g})"

    def judged_target(self, out, sampling, p):
        if not self.greedy:
            return p
        # the same pipeline, untempered, so the neighbours carry mass
        return probabilities(out, replace(sampling, temperature=1.0), watch=None)  # p's logits are noted already

    def neighbourhood(self, p, x):
        """x's candidate neighbours [..., k-1], their target mass, and which of them form A. A is empty for a
        draft outside the target's support (cut by top-k/top-p): moving mass onto it would put an excluded
        code back into the distribution."""
        members = self.neighbours.to(p.device)[x][..., 1:].long()
        mass = p.gather(-1, members)
        p_x = at(p, x).unsqueeze(-1)
        within = mass.cumsum(-1) <= (self.lam - 1.0) * p_x if self.lam else mass.cumsum(-1) < self.delta
        return members, mass, within & (p_x > 0)

    def accept_probability(self, p, q, x):
        members, mass, in_a = self.neighbourhood(p, x)
        relaxed = at(p, x) + (mass * in_a).sum(-1)
        if self.greedy:  # x must beat every code p_A keeps: all but A and x itself
            others = without_a(p, members, mass, in_a).scatter(-1, x.unsqueeze(-1), 0.0).amax(-1)
            return (relaxed >= others).float()
        return (relaxed / at(q, x).clamp_min(_TINY)).clamp(max=1.0)

    def distorted(self, p, x):
        """p_A: the target with A's mass moved onto x."""
        members, mass, in_a = self.neighbourhood(p, x)
        moved = at(p, x).unsqueeze(-1) + (mass * in_a).sum(-1, keepdim=True)
        return without_a(p, members, mass, in_a).scatter(-1, x.unsqueeze(-1), moved)

    def residual(self, p, q, x):
        if self.greedy:  # after a greedy rejection the target's argmax is outside A, so it is p_A's too
            return torch.nn.functional.one_hot(p.argmax(-1), p.shape[-1]).float()
        return positive_residual(self.distorted(p, x), q)
