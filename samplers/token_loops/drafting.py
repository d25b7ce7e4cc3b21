"""What a drafter drafts per target forward: a chain, a static tree or an EAGLE-2 dynamic tree, and how.

- Chains and static trees (``StaticGrower``) grow depth by depth: the drafter's distribution q at every node of a
  depth gives that node's children in sibling order, sampled without replacement (each sibling recorded with the
  q it was drawn from: the parent's q without the siblings drawn before it) or the drafter's top codes (recorded
  one-hot); the drafter then reads the new depth to draft the next.
- Dynamic trees (``DynamicGrower``, EAGLE-2's): the drafter's top codes only. From the root, each depth expands the
  ``topk`` best nodes so far by path score (the sum of the drafter's log-probabilities along the path) into their
  ``topk`` most likely children each; after ``depth`` depths the ``nodes`` best nodes drafted form the tree, one per
  row, with a fixed node count (one compiled shape).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import FastARError, check_choice
from ...model_loaders.shared.protocol import ModelOutput
from .loop_step import LoopStep
from .trees import STATIC_SHAPES, TREE_KINDS, DraftTree, chain, static_tree, tree_from_parents
from ..processing import Pipeline, current_watch, guided_logits, probabilities, sample

DRAFTS = ("sampled", "top")  # how a drafter proposes: a draw from its q, or its most likely code
NO_MASS = -1e4  # a path score's step where the drafter gives a code no mass: finite, so scores still order paths


@dataclass(frozen=True)
class TreeSettings:
    """``kind`` "chain" (``gamma`` drafts), "static" (the named ``shape``) or "dynamic" (EAGLE-2: ``nodes`` drafts
    at most ``depth`` deep, each depth expanding the ``topk`` best nodes into ``topk`` children each)."""

    kind: str = "chain"
    gamma: int = 4
    shape: str = "lantern++57"
    depth: int = 5
    topk: int = 10
    nodes: int = 58  # LANTERN's total_token 59 counts the root

    def validate(self) -> "TreeSettings":
        check_choice("draft tree", self.kind, TREE_KINDS)
        check_choice("tree shape", self.shape, tuple(STATIC_SHAPES))
        if self.gamma < 1:
            raise FastARError(f"gamma {self.gamma} is too small: draft at least 1 token per target forward")
        if self.depth < 1 or self.topk < 1:
            raise FastARError(f"a dynamic tree needs a depth and a top-k of at least 1 (got {self.depth} and "
                              f"{self.topk})")
        if not 1 <= self.nodes <= self.topk * (1 + (self.depth - 1) * self.topk):
            raise FastARError(f"a dynamic tree of depth {self.depth} and top-k {self.topk} drafts at most "
                              f"{self.topk * (1 + (self.depth - 1) * self.topk)} nodes: ask for 1 to that many "
                              f"(got {self.nodes})")
        return self

    @property
    def width(self) -> int:
        """The tokens a target forward feeds per image: the drafts and the root."""
        if self.kind == "static":
            return sum(map(sum, STATIC_SHAPES[self.shape])) + 1
        return (self.gamma if self.kind == "chain" else self.nodes) + 1

    def described(self) -> dict:
        """The settings a run's stats name."""
        if self.kind == "chain":
            return {"gamma": self.gamma}
        if self.kind == "static":
            return {"tree": self.shape}
        return {"tree": "dynamic", "tree_depth": self.depth, "tree_topk": self.topk, "tree_nodes": self.nodes}

    def shape_of(self, tokens: int, device) -> DraftTree:
        """The tree the target verifies: static shapes as they are; a dynamic tree's node count and depth (its
        structure comes per row with each draft)."""
        if self.kind == "chain":
            return chain(min(self.gamma, tokens - 1), device)
        if self.kind == "static":
            return static_tree(self.shape, device)
        parent = torch.zeros(1, self.nodes + 1, dtype=torch.long, device=device)  # a stand-in: rows bring their own
        return tree_from_parents(parent, self.depth, self.topk)

    def drafter_nodes(self, shape: DraftTree) -> int:
        """The tree nodes the drafter feeds per iteration (a dynamic tree's: every depth's expanded nodes)."""
        return shape.nodes if self.kind != "dynamic" else 1 + (self.depth - 1) * self.topk

    def grower(self, shape: DraftTree, draft_session, pipeline: Pipeline, drafts: str, session, generator, batch: int):
        # the drafter's steps compile when the target's do (compiled.py: compile_like, following_mode): its picks too
        if self.kind == "dynamic":
            top = ByNodesFed(lambda: LoopStep(TopCodes(pipeline, current_watch(), self.topk), session, generator))
            return DynamicGrower(self, draft_session, top, batch)
        pick = ByNodesFed(lambda: LoopStep(DraftPick(pipeline, current_watch(), drafts == "top", shape.siblings),
                                           session, generator))
        return StaticGrower(shape.rows(batch), draft_session, pick)


class ByNodesFed:
    """A loop step per count of nodes fed at once (a tree's depths feed different counts): a loop step's draws keep
    one shape for the whole generation (drawn_noise.py)."""

    def __init__(self, make):
        self.make, self.steps = make, {}

    def __call__(self, cond, uncond):
        if cond.shape[1] not in self.steps:
            self.steps[cond.shape[1]] = self.make()
        return self.steps[cond.shape[1]](cond, uncond)


class StaticGrower:
    """Drafts a chain or a static tree; ``draft`` gives the drafts ``x`` [B, M], the distributions ``q`` [B, M, V]
    they were drawn from, and None (every row has the static tree)."""

    def __init__(self, tree: DraftTree, draft_session, pick: ByNodesFed):
        self.tree, self.session, self.pick = tree, draft_session, pick

    def draft(self, seq, n, last_out, last_start):
        tree, xs, qs = self.tree, [], []
        out = self.session.catch_up(seq, n, last_out, last_start)
        for level in tree.levels_plan:
            above = level.parents
            if above.start > 0:
                x = torch.cat(xs, 1)
                if tree.is_chain:
                    out = self.session.step(x[:, -1:], n + above.start - 1)
                else:
                    fed = slice(above.start, above.stop)
                    out = self.session.grow(x[:, above.start - 1:above.stop - 1], n - 1, tree.depth,
                                            tree.ancestors[:, fed, :], tree.parent[:, fed], above.start)
            codes, dists = self.pick(out.cond, out.uncond)
            xs.append(codes[:, level.parent, level.rank])
            qs.append(dists[:, level.parent, level.rank])
        return torch.cat(xs, 1), torch.cat(qs, 1), None


class DynamicGrower:
    """Drafts an EAGLE-2 dynamic tree per row; ``draft`` gives the drafts ``x`` [B, M], their one-hot ``q`` and each
    row's tree. The drafter feeds ``topk`` nodes per depth (its own tree: the nodes expanded), the target verifies
    the ``nodes`` best of everything drafted, in drafting order (so by depth, parents first, siblings by rank)."""

    def __init__(self, settings: TreeSettings, draft_session, top: ByNodesFed, batch: int):
        self.settings, self.session, self.top, self.batch = settings, draft_session, top, batch

    def draft(self, seq, n, last_out, last_start):
        K, depth, B = self.settings.topk, self.settings.depth, self.batch
        out = self.session.catch_up(seq, n, last_out, last_start)
        codes, logq = self.top(out.cond, out.uncond)  # [B, 1, K]: the root's children
        device = codes.device
        fed = 1 + (depth - 1) * K  # the drafter's own tree: the root, then K expanded nodes per depth
        fed_parent = torch.zeros(B, fed, dtype=torch.long, device=device)
        fed_ancestors = torch.eye(fed, dtype=torch.bool, device=device).repeat(B, 1, 1)
        fed_ancestors[:, :, 0] = True
        fed_depth = ((torch.arange(fed, device=device) + K - 1) // K).expand(B, fed)  # 0, then K of each depth
        drafted, scores, drafted_parent = [codes[:, 0]], [logq[:, 0]], [torch.full((B, K), -1, device=device)]
        frontier, frontier_scores, frontier_ids = codes[:, 0], logq[:, 0], torch.arange(K, device=device).expand(B, K)
        frontier_nodes = torch.zeros(B, K, dtype=torch.long, device=device)  # their parents among the fed nodes
        rows = torch.arange(B, device=device)[:, None]
        for d in range(1, depth):
            first = 1 + (d - 1) * K
            nodes = torch.arange(first, first + K, device=device)
            fed_parent[:, first:first + K] = frontier_nodes
            fed_ancestors[:, first:first + K] |= fed_ancestors[rows, frontier_nodes]
            out = self.session.grow(frontier, n - 1, fed_depth, fed_ancestors[:, first:first + K], frontier_nodes,
                                    first)
            codes, logq = self.top(out.cond, out.uncond)  # [B, K, K]
            path_scores = (frontier_scores.unsqueeze(-1) + logq).flatten(1)
            drafted.append(codes.flatten(1))
            scores.append(path_scores)
            drafted_parent.append(frontier_ids.repeat_interleave(K, 1))
            best = path_scores.topk(K, dim=-1).indices
            offset = sum(x.shape[1] for x in drafted[:-1])
            frontier, frontier_scores = codes.flatten(1).gather(1, best), path_scores.gather(1, best)
            frontier_ids, frontier_nodes = offset + best, nodes[best // K]
        drafted, scores, drafted_parent = (torch.cat(t, 1) for t in (drafted, scores, drafted_parent))
        chosen = scores.topk(self.settings.nodes, dim=-1).indices.sort(-1).values  # in drafting order: by depth
        parent_id = drafted_parent.gather(1, chosen)
        # a node's parent scores above it (NO_MASS keeps every step negative), so it was chosen too: find its place
        parent = torch.where(parent_id < 0, 0, torch.searchsorted(chosen, parent_id.clamp(min=0)) + 1)
        tree = tree_from_parents(torch.cat([torch.zeros_like(parent[:, :1]), parent], 1), depth, K)
        x = drafted.gather(1, chosen)
        return x, torch.nn.functional.one_hot(x, out.cond.shape[-1]).float(), tree


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
        out = ModelOutput(cond=cond, uncond=uncond)
        q = probabilities(out, self.pipeline, self.watch)
        if self.top:  # (past the codebook's size, the last code again: rejected before, so never accepted)
            x = top_codes(out, q, self.pipeline, min(self.siblings, q.shape[-1])).indices
            x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], self.siblings - x.shape[-1])], -1)
            return x, torch.nn.functional.one_hot(x, q.shape[-1]).to(q.dtype)
        codes, dists = [], []
        for sibling in range(self.siblings):
            if sibling:
                q = without_drawn(q, codes[-1], dists[0])
            codes.append(sample(q, noise))
            dists.append(q)
        return torch.stack(codes, -1), torch.stack(dists, -2)


def top_codes(out: ModelOutput, q: torch.Tensor, pipeline: Pipeline, k: int):
    """The drafter's ``k`` most likely codes (torch.topk's values and indices): by its guided logits within the support
    of its processed ``q`` (greedy: every code, ranked as EAGLE's and LANTERN's reference code ranks them, where q
    itself is one-hot)."""
    logits = guided_logits(out, pipeline)
    return (logits if pipeline.greedy else logits.masked_fill(q <= 0, float("-inf"))).topk(k, dim=-1)


def without_drawn(q, x, original):
    """``q`` without code ``x``, renormalised: the next sibling's distribution. Once every code of the drafter's
    support is drawn, the next siblings are drawn from ``original`` again (any distribution keeps the tree exact, as
    long as the one recorded is the one drawn from)."""
    left = q.scatter(-1, x.unsqueeze(-1), 0.0)
    mass = left.sum(-1, keepdim=True)
    return torch.where(mass > 1e-12, left / mass.clamp_min(1e-12), original)


@dataclass(eq=False)
class TopCodes:
    """The drafter's ``k`` most likely codes at each node fed and their log-probabilities under its processed q (greedy:
    under its guided logits), strictly negative and finite, so a child always scores below its parent. A loop step
    (loop_step.py)."""

    pipeline: Pipeline
    watch: object
    k: int

    def body(self, noise, cond, uncond):
        out = ModelOutput(cond=cond, uncond=uncond)
        q = probabilities(out, self.pipeline, self.watch)
        codes = top_codes(out, q, self.pipeline, min(self.k, q.shape[-1])).indices
        # greedy: the log-probabilities of the guided logits, as the reference's; else those of the processed q
        logp = guided_logits(out, self.pipeline).log_softmax(-1) if self.pipeline.greedy else q.log()
        logq = logp.gather(-1, codes).clamp(min=NO_MASS, max=-1e-6)
        missing = self.k - codes.shape[-1]  # a codebook smaller than k: its last code again, with no mass
        codes = torch.cat([codes, codes[..., -1:].expand(*codes.shape[:-1], missing)], -1)
        return codes, torch.cat([logq, torch.full_like(logq[..., :1], NO_MASS).expand(*logq.shape[:-1], missing)], -1)
