"""Draft trees: which drafts a speculative iteration verifies, and how they hang together.

A tree's node 0 is the root: the last fixed token, at position ``start``. Draft nodes 1..M follow in order of
depth (a node's depth is its distance from the root: node m stands at position ``start + depth[m]``), and a
node's children are tried in sibling order (the order they were drafted in). A chain of L drafts is the tree
whose node m is node m - 1's only child: every speculative loop verifies trees (verifier.verify_tree).

Shapes are tensors, either one for every row (a static tree: ``rows`` is 1) or one per row (EAGLE-2's dynamic
trees, built from each row's drafter scores); either way the node count is fixed, so a compiled step sees one
shape.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import FastARError, check_choice

TREE_KINDS = ("chain", "static", "dynamic")

# LANTERN++'s static tree (its reference's ``naive_extend_57``): per depth, how many children each node of the
# depth above gets, the nodes of a depth listed in order (parents in order, each parent's children by rank).
# 5, 13, 16, 14 and 9 nodes at depths 1 to 5.
_LANTERN_PP_57 = (
    (5,),
    (4, 3, 3, 2, 1),
    (4, 3, 3, 2, 2, 1, 0, 1, 0, 0, 0, 0, 0),
    (4, 3, 2, 1, 2, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0),
    (3, 2, 0, 0, 2, 1, 0, 1, 0, 0, 0, 0, 0, 0),
)
STATIC_SHAPES = {"lantern++57": _LANTERN_PP_57}


@dataclass(frozen=True)
class DraftTree:
    """``parent`` [R, M+1] (the root is its own parent), ``depth`` [R, M+1], ``children`` [R, M+1, S] (node indices
    in sibling order, -1 past a node's last child) and ``ancestors`` [R, M+1, M+1] (node i's ancestors and itself);
    R is 1 (every row has this tree) or the batch."""

    parent: torch.Tensor
    depth: torch.Tensor
    children: torch.Tensor
    ancestors: torch.Tensor
    levels: int  # the deepest a node may be (known on the host: a path's length is at most this)
    is_chain: bool = False

    @property
    def nodes(self) -> int:
        """Draft nodes (the root not counted)."""
        return self.parent.shape[1] - 1

    @property
    def siblings(self) -> int:
        """The most children a node has."""
        return self.children.shape[2]

    def rows(self, batch: int) -> "DraftTree":
        """The tree of each of ``batch`` rows (a static tree repeated)."""
        if self.parent.shape[0] == batch:
            return self
        return DraftTree(*(t.expand(batch, *t.shape[1:]) for t in (self.parent, self.depth, self.children,
                                                                   self.ancestors)), self.levels, self.is_chain)

    def nodes_at(self, depth: int) -> range:
        """The nodes of ``depth`` in a static tree (contiguous: nodes go in order of depth)."""
        at = (self.depth[0] == depth).nonzero().flatten().tolist()
        return range(at[0], at[-1] + 1) if at else range(0)


def tree_from_parents(parent: torch.Tensor, levels: int | None = None, is_chain: bool = False) -> DraftTree:
    """The tree of ``parent`` [R, M+1] (node 0 the root, parents before their children, siblings in order);
    ``levels``: a bound on its depth (default: its depth, read here)."""
    R, T = parent.shape
    device = parent.device
    node = torch.arange(T, device=device)
    ancestors = torch.eye(T, dtype=torch.bool, device=device).repeat(R, 1, 1)
    depth = torch.zeros(R, T, dtype=torch.long, device=device)
    rows = torch.arange(R, device=device)
    for m in range(1, T):  # parents come first: their rows are complete when a child copies them
        p = parent[:, m]
        ancestors[:, m] |= ancestors[rows, p]
        depth[:, m] = depth[rows, p] + 1
    is_child = (parent[:, None, :] == node[None, :, None]) & (node[None, None, :] > 0)  # [R, parent, child]
    siblings = max(int(is_child.sum(-1).max()), 1)
    rank = is_child.long().cumsum(-1) - 1  # a child's rank among its parent's children
    children = torch.full((R, T, siblings), -1, dtype=torch.long, device=device)
    parents, kids = is_child.nonzero(as_tuple=True)[0:2], is_child.nonzero(as_tuple=True)[2]
    children[parents[0], parents[1], rank[parents[0], parents[1], kids]] = kids
    levels = int(depth.max()) if levels is None else levels
    return DraftTree(parent, depth, children, ancestors, levels, is_chain)


def chain(drafts: int, device=None) -> DraftTree:
    """``drafts`` drafts in a row: node m's only child is node m + 1."""
    parent = (torch.arange(drafts + 1, device=device) - 1).clamp(min=0)[None]
    return tree_from_parents(parent, drafts, is_chain=True)


def static_tree(name: str, device=None) -> DraftTree:
    """A named static shape (``STATIC_SHAPES``)."""
    check_choice("tree shape", name, tuple(STATIC_SHAPES))
    parents, level = [0], [0]  # node 0 is its own parent; the nodes of the depth above
    for counts in STATIC_SHAPES[name]:
        if len(counts) != len(level):
            raise FastARError(f"tree shape {name}: {len(counts)} child counts for {len(level)} nodes")
        below = []
        for node, count in zip(level, counts):
            below += [len(parents) + i for i in range(count)]
            parents += [node] * count
        level = below
    return tree_from_parents(torch.tensor(parents, device=device)[None])
