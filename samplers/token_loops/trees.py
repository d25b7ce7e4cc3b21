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
class Level:
    """The nodes of one depth of a static tree and where each hangs: its parent among the nodes of the depth above
    (``parent`` [K]) and its rank among that parent's children (``rank`` [K]), on the tree's device."""

    parents: range  # the nodes of the depth above
    nodes: range
    parent: torch.Tensor
    rank: torch.Tensor


@dataclass(frozen=True)
class DraftTree:
    """``parent`` [R, M+1] (the root is its own parent), ``depth`` [R, M+1], ``children`` [R, M+1, S] (node indices
    in sibling order, -1 past a node's last child) and ``ancestors`` [R, M+1, M+1] (node i's ancestors and itself);
    R is 1 (every row has this tree) or the batch. A static tree also knows its ``levels_plan`` on the host."""

    parent: torch.Tensor
    depth: torch.Tensor
    children: torch.Tensor
    ancestors: torch.Tensor
    levels: int  # the deepest a node may be (known on the host: a path's length is at most this)
    is_chain: bool = False
    levels_plan: tuple[Level, ...] = ()

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
        expanded = (t.expand(batch, *t.shape[1:]) for t in (self.parent, self.depth, self.children, self.ancestors))
        return DraftTree(*expanded, self.levels, self.is_chain, self.levels_plan)

    def nodes_at(self, depth: int) -> range:
        """The nodes of ``depth`` in a static tree."""
        return range(0, 1) if depth == 0 else self.levels_plan[depth - 1].nodes


def tree_from_parents(parent: torch.Tensor, levels: int, siblings: int, is_chain: bool = False) -> DraftTree:
    """The tree of ``parent`` [R, M+1] (node 0 the root, parents before their children, siblings in node order), no
    deeper than ``levels``, no node with more than ``siblings`` children; built on the device without waiting for it."""
    R, T = parent.shape
    node = torch.arange(T, device=parent.device)
    ancestors = torch.zeros(R, T, T, dtype=torch.bool, device=parent.device)
    depth = torch.zeros(R, T, dtype=torch.long, device=parent.device)
    up = node.expand(R, T)
    for _ in range(levels + 1):  # walk every node up to the root, marking what it passes
        ancestors.scatter_(2, up.unsqueeze(-1), True)
        depth += (up != 0).long()
        up = parent.gather(1, up)
    is_child = (parent.unsqueeze(1) == node.view(1, T, 1)) & (node > 0)  # [R, parent, child]
    rank = (is_child.long().cumsum(-1) - 1).gather(1, parent.unsqueeze(1)).squeeze(1)  # each node's, under its parent
    slot = torch.where((node > 0) & (rank < siblings), parent * siblings + rank, T * siblings)
    children = torch.full((R, T * siblings + 1), -1, dtype=torch.long, device=parent.device)
    children.scatter_(1, slot, node.expand(R, T))
    return DraftTree(parent, depth, children[:, :-1].view(R, T, siblings), ancestors, levels, is_chain)


_BUILT: dict = {}


def chain(drafts: int, device=None) -> DraftTree:
    """``drafts`` drafts in a row: node m's only child is node m + 1."""
    return _static(("chain", drafts), [(1,)] * drafts, device, is_chain=True)


def static_tree(name: str, device=None) -> DraftTree:
    """A named static shape (``STATIC_SHAPES``)."""
    check_choice("tree shape", name, tuple(STATIC_SHAPES))
    return _static(("shape", name, STATIC_SHAPES[name]), STATIC_SHAPES[name], device)


def _static(key, counts_per_depth, device, is_chain=False) -> DraftTree:
    """A static tree from its child counts per depth, built once per process and device (on the host, then copied:
    a generation that asks for it again reads nothing back from the device)."""
    key = (*key, str(device or "cpu"))
    if key in _BUILT:
        return _BUILT[key]
    parents, level, plan = [0], [0], []  # node 0 is its own parent; the nodes of the depth above
    for counts in counts_per_depth:
        if len(counts) != len(level):
            raise FastARError(f"tree shape {key[1]}: {len(counts)} child counts for {len(level)} nodes")
        first = len(parents)
        local, rank = [], []
        for i, count in enumerate(counts):
            local += [i] * count
            rank += list(range(count))
            parents += [level[i]] * count
        plan.append((range(level[0], level[-1] + 1), range(first, len(parents)), local, rank))
        level = list(range(first, len(parents)))
    siblings = max(max(counts) for counts in counts_per_depth) if counts_per_depth else 1
    tree = tree_from_parents(torch.tensor([parents]), len(counts_per_depth), max(siblings, 1), is_chain)
    plan = tuple(Level(above, nodes, torch.tensor(local, device=device), torch.tensor(rank, device=device))
                 for above, nodes, local, rank in plan)
    tensors = (t.to(device) for t in (tree.parent, tree.depth, tree.children, tree.ancestors))
    _BUILT[key] = DraftTree(*tensors, tree.levels, is_chain, plan)
    return _BUILT[key]
