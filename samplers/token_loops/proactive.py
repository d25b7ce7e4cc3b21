"""SJD-PAC (Kang et al., CVPR 2026): Jacobi windows whose front is a small tree, lossless.

The window is a static tree (``pac_tree``): a main chain of drafts, and at its first ``depth - 1`` depths every node
has ``branches`` children, the same candidates at a depth under every parent (each depth's candidates drawn without
replacement). One forward verifies it; the shared verifier walks it by recursive rejection sampling. Then:

- adaptive continuation: the drafts below the accepted path, carried on to the next window, follow the coupling
  (the maximal coupling is the paper's: a draft stays with probability min(1, p/q) under the output computed behind
  it, else it is redrawn from the residual), so a rejection no longer throws the window's tail away;
- proactive drafting: each branched depth's other candidates are drawn from the same distribution as its first,
  without replacement, and recorded so: where the first draft fails, a sibling may pass.

Exactness needs every draft to have the law its recorded q says, given what decides the acceptance of the drafts
before it. The reference code breaks that in three places, which FastAR does not copy: siblings drawn from the
residual (recorded as drawn from p), the longest accepted path instead of the first accepted sibling, and an
unverified random token when every draft passes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import FastARError
from ..processing import sample
from .drafting import without_drawn
from .drafts import DraftSource
from .trees import DraftTree, _static
from .verifier import WindowVerifier


@dataclass(frozen=True)
class PacSettings:
    """A window of ``window`` tokens (the root and its drafts) whose first ``depth - 1`` depths branch ``branches``
    ways."""

    window: int = 32
    branches: int = 2  # the demo's best (the paper's code: 3)
    depth: int = 3

    def validate(self) -> "PacSettings":
        if self.branches < 1 or self.depth < 1:
            raise FastARError(f"SJD-PAC needs at least 1 branch and a depth of at least 1 (got {self.branches} and "
                              f"{self.depth})")
        if self.main_drafts < self.depth:
            smallest = self.window - self.main_drafts + self.depth
            raise FastARError(f"a window of {self.window} tokens cannot hold a tree of {self.branches} branches "
                              f"{self.depth} deep: give a window of at least {smallest}, or fewer branches")
        return self

    @property
    def branch_nodes(self) -> int:
        """The drafts off the main chain: full subtrees under every branched node's other children."""
        K, D = self.branches, self.depth
        full = D if K == 1 else (K ** D - 1) // (K - 1)  # a full K-ary tree of D levels, the root included
        return full - D

    @property
    def main_drafts(self) -> int:
        return self.window - 1 - self.branch_nodes


@dataclass(frozen=True)
class PacShape:
    """The window's tree for ``main`` drafts along its main chain, and what carries it on: ``rank`` [M+1] (each node's
    rank among its parent's children), ``follow`` [M+1, main+2] (from node s, the node j depths below it: down first
    children, else on the main chain at that depth; -1 past the window)."""

    tree: DraftTree
    rank: torch.Tensor
    follow: torch.Tensor
    main: int
    branched: int  # the depths with siblings (1..branched)
    branches: int


_BUILT: dict = {}


def pac_shape(settings: PacSettings, tokens: int, device) -> PacShape:
    """The tree of ``settings`` for an image of ``tokens`` tokens (a window never longer than the image), built once per
    process and device on the host (a generation that asks for it again reads nothing back from the device)."""
    K, D = settings.branches, settings.depth
    main = min(settings.main_drafts, tokens - 1)
    key = (K, D, main, str(device))
    if key not in _BUILT:
        counts = child_counts(K, min(D - 1, main), main)
        rank, follow = carrying_tables(_static(("pac", K, D, main), counts, "cpu"), main)
        _BUILT[key] = PacShape(_static(("pac", K, D, main), counts, device), rank.to(device), follow.to(device), main,
                               min(D - 1, main), K)
    return _BUILT[key]


def child_counts(branches: int, branched: int, main: int) -> list[tuple[int, ...]]:
    """Per depth, the children of each node of the depth above: ``branches`` at the branched depths, then one under the
    main node (the first of its depth) only."""
    counts, width = [], 1
    for d in range(1, main + 1):
        counts.append((branches,) * width if d <= branched else (1,) + (0,) * (width - 1))
        width = width * branches if d <= branched else 1
    return counts


def carrying_tables(tree: DraftTree, main: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``PacShape``'s ``rank`` and ``follow`` of a tree on the host."""
    depth, children = tree.depth[0].tolist(), tree.children[0].tolist()
    main_node = [0] + [tree.nodes_at(d)[0] for d in range(1, main + 1)]
    rank = [0] * len(depth)
    for node_children in children:
        for r, child in enumerate(c for c in node_children if c >= 0):
            rank[child] = r
    follow = []
    for s in range(len(depth)):
        row, node = [s], s
        for _ in range(main + 1):
            first = children[node][0] if node >= 0 else -1
            below = depth[node] + 1 if node >= 0 else main + 1
            node = first if first >= 0 else main_node[below] if below <= main else -1
            row.append(node)
        follow.append(row)
    return torch.tensor(rank), torch.tensor(follow)


@dataclass(eq=False)
class PacIteration(WindowVerifier):
    """An SJD-PAC iteration after its forward: verification of the window's tree, then the next window's drafts. A loop
    step (loop_step.py)."""

    drafts: DraftSource
    shape: PacShape

    def body(self, noise, cond, uncond, x, q, n, iteration):
        iteration = iteration + 1
        p, k, path, count = self.verify(noise, cond, uncond, q, x, n, iteration)
        B, V, tree = x.shape[0], p.shape[-1], self.tree.rows(x.shape[0])
        stop = torch.where(k > 0, path.gather(1, (k - 1).clamp(min=0).unsqueeze(1)).squeeze(1), 0)
        follow = self.shape.follow[stop]  # [B, main+2]: follow[:, 1] holds the token fixed now (the new root)
        child = follow[:, 2:]  # the old draft below each new depth 1..main, if any
        pred = torch.where(child >= 0, tree.parent.gather(1, child.clamp(min=0)), follow[:, 1:-1])  # whose p predicts it
        has_pred, has_draft = pred >= 0, child >= 0
        n = n + count
        positions = n.unsqueeze(1) - 1 + torch.arange(1, self.shape.main + 1, device=p.device)
        target = p.gather(1, pred.clamp(min=0).unsqueeze(-1).expand(B, self.shape.main, V))
        carried_x = self.drafts.refine(target, x.gather(1, (child - 1).clamp(min=0)),
                                       q.gather(1, (child - 1).clamp(min=0).unsqueeze(-1).expand(B, self.shape.main, V)),
                                       positions, noise, has_draft)
        seq = self.buffer.seq
        seq.scatter_(1, torch.where(has_pred, positions, self.buffer.scratch), carried_x)
        carried = has_pred.sum(1)
        last = p.gather(1, follow.gather(1, carried.unsqueeze(1)).clamp(min=0).unsqueeze(-1).expand(B, 1, V))[:, 0]
        fresh_x, fresh_q = self.drafts.initial(seq, n, carried, last, noise)
        first = torch.where(has_pred, carried_x, fresh_x)
        first_q = torch.where(has_pred.unsqueeze(-1), target, fresh_q)
        x, q = self.assemble(first, first_q, noise)
        return x, q, n, count, iteration, k, path

    def first_window(self, seq, n, p0, noise):
        """The first window's drafts and their q: every depth initialised afresh."""
        first, first_q = self.drafts.initial(seq, n, torch.zeros_like(n), p0, noise)
        return self.assemble(first, first_q, noise)

    def assemble(self, first, first_q, noise):
        """The window's drafts ``x`` [B, M] and their q [B, M, V] from each main depth's first candidate ``first``
        [B, main] (drawn from ``first_q`` [B, main, V]): a branched depth's other candidates are drawn from the same q
        without replacement, and every node takes its depth's candidate of its own rank."""
        K, main, branched = self.shape.branches, self.shape.main, self.shape.branched
        codes, dists = [first], [first_q]
        q = first_q[:, :branched]
        for _ in range(1, K):
            q = without_drawn(q, codes[-1][:, :branched], first_q[:, :branched])
            drawn = sample(q, noise)
            codes.append(torch.cat([drawn, first[:, branched:]], 1))  # unbranched depths: never used
            dists.append(torch.cat([q, first_q[:, branched:]], 1))
        codes, dists = torch.stack(codes, 1).flatten(1, 2), torch.stack(dists, 1).flatten(1, 2)  # [B, K * main]
        node = (self.shape.rank * main + self.tree.depth[0] - 1)[1:]
        return codes[:, node], dists[:, node]
