"""What the draft-tree builders share (llamagen.py lantern_trees / lantern_t2i_trees, chameleon.py --only
anole_lantern_trees): LANTERN's two trees at its defaults, the official drafter's guided logits recorded per draft
call, and the checks that make a greedy tree fixture meaningful.

LANTERN's official code drafts trees two ways (models/drafters/cnets_*.py):
- static (``EaModel.generate(static_tree=True)``, ``Model.topK_genrate_v1``): ``choices.naive_extend_57``, each node's
  children the drafter's top codes by its CFG-combined logits (logits_processor None: ``torch.topk(logits, 10)``);
- dynamic (``Model.topK_genrate``, EAGLE-2): the root's 10 best children by log-softmax, ``depth`` (4) expansions of
  the 10 best frontier nodes by path score into 10 children each, then the ``total_token - 1`` (58) best of everything
  drafted (by score, kept in drafting order).
Greedy verification (``evaluate_posterior(_v1)`` with logits_processor None) accepts the longest root-to-node path
whose codes are the target's greedy codes, plus the target's next code.

A greedy fixture is only meaningful where float order cannot change it: ``PathMargins`` re-derives each iteration's
accept length from the recorded logits (and asserts it is the official one) while measuring how far each decision
on the target's path is from flipping (a sibling's rank against its neighbour's, a node's score against the
selection boundary); ``BoundaryGaps`` measures the dynamic tree's selection boundaries that decide which other nodes
are drafted; ``perturbed`` reruns an official run with the drafter's logits shaken, whose accept lengths must not
move.
"""
from __future__ import annotations

import contextlib

import torch

TOTAL_TOKEN, DEPTH, TOP_K = 59, 4, 10  # EaModel.from_pretrained's defaults (ea_model_llamagen.py, ea_model_anole.py)
# a decision closer than this to flipping (logit or path-score units) is a near tie: above the largest difference
# between FastAR's drafter logits and the official drafter's that the drafts tests measure (7.0e-5 t2i, 2.3e-5 Anole),
# below the chain builders' 1e-3 because the Anole drafter's logits over 8192 codes sit closer (its smallest path
# margin is 5.1e-4; the LlamaGen rows' are over 6e-3)
TIE = 2e-4
SHAKE = TIE / 2  # the shaken reruns' noise: it cannot flip a path decision (margins > TIE), only nearer ties elsewhere
SHAKES = 3  # reruns with shaken drafter logits
CHECKS = (
    "Checks (build/trees.py): every iteration's accept length re-derived from the recorded drafter logits equals the "
    f"official one, and no decision on the target's path is within {TIE:g} of flipping (path_margin: the smallest, "
    "at path_margin_at; a sibling's rank against its neighbour's where the swap changes the tree, a node's path score "
    "against its selection boundary); near_boundaries: dynamic selection boundaries (K-th vs (K+1)-th frontier "
    f"score, 58th vs 59th kept) within {TIE:g} of all seen, which only decide other nodes; the accept lengths do not "
    f"move in {SHAKES} reruns with the drafter's guided logits shaken by up to {SHAKE:g}; off_top_iterations: "
    "iterations whose accepted path passes a code that is not its parent's top-1 (which no chain drafts). FastAR "
    "flags: --tree-depth 5 (LANTERN's depth 4 counts expansions), --tree-nodes 58 (LANTERN's total_token 59 counts "
    "the root)")


def summary(margins: "PathMargins", gaps: "BoundaryGaps") -> dict:
    """The checks' numbers an expected_trees.json run keeps."""
    assert margins.worst > TIE, f"a decision on the target's path is a near tie: {margins.where} ({margins.worst:.1e})"
    print(f"path margin {margins.worst:.2e} ({margins.where}; {margins.checked} decisions), selection boundaries "
          f"within {TIE:g}: {gaps.near} of {gaps.seen}, iterations accepting a code off the top-1 chain: "
          f"{margins.off_top}", flush=True)
    return {"path_margin": margins.worst, "path_margin_at": margins.where, "near_boundaries": [gaps.near, gaps.seen],
            "off_top_iterations": margins.off_top}


def fastar_args(kind: str) -> list:
    """FastAR's flags for the official tree: ``--tree-depth`` is the deepest a draft may be (LANTERN's ``depth`` counts
    expansions: depth 4 drafts 5 deep) and ``--tree-nodes`` counts drafts (LANTERN's ``total_token`` counts the root
    too: 59 verifies 58 drafts)."""
    if kind == "static":
        return ["--drafts", "top", "--tree", "static", "--tree-shape", "lantern++57", "--temperature", 0]
    return ["--drafts", "top", "--tree", "dynamic", "--tree-depth", DEPTH + 1, "--tree-topk", TOP_K,
            "--tree-nodes", TOTAL_TOKEN - 1, "--temperature", 0]


class DraftLogits:
    """Records the official drafter's guided logits per draft call: wraps the cnets module's ``cfg_logit_process``
    (which topK_genrate and topK_genrate_v1 call on every head output, before cnets_anole blanks non-image ids in
    place: the tensor kept is the one ranked) and the drafter's ``topK_genrate``/``topK_genrate_v1`` (a call = one
    tree). ``shake`` adds uniform noise of that size to every guided logit (``perturbed``)."""

    def __init__(self, cnets, drafter, shake: float = 0.0, seed: int = 0):
        self.cnets, self.drafter, self.shake, self.calls = cnets, drafter, shake, []
        self.generator = torch.Generator().manual_seed(seed)

    def __enter__(self):
        self.original = self.cnets.cfg_logit_process

        def guided(*args, **kwargs):
            out = self.original(*args, **kwargs)
            if self.shake:
                noise = torch.rand(out.shape, generator=self.generator, dtype=torch.float64) * 2 - 1
                out = out + (noise * self.shake).to(out.dtype)
            if self.calls:
                self.calls[-1].append(out)
            return out

        self.cnets.cfg_logit_process = guided
        for name in ("topK_genrate", "topK_genrate_v1"):
            bound = getattr(self.drafter, name)

            def call(*args, _bound=bound, **kwargs):
                self.calls.append([])
                return _bound(*args, **kwargs)

            setattr(self.drafter, name, call)
        return self

    def __exit__(self, *exc):
        self.cnets.cfg_logit_process = self.original
        for name in ("topK_genrate", "topK_genrate_v1"):
            del self.drafter.__dict__[name]

    def rows(self, call: int) -> list:
        """The guided logits of draft call ``call``, one [nodes, V] matrix per head call, as ranked."""
        return [m[0].float() if m.dim() == 3 else m.float() for m in self.calls[call]]


def rank_of(logits: torch.Tensor, code: int) -> tuple[int, torch.Tensor]:
    """``code``'s rank among ``logits`` [V] (0 = best) and the logits in descending order."""
    ordered = logits.sort(descending=True)
    return int((ordered.indices == code).nonzero()[0, 0]), ordered.values


class PathMargins:
    """Re-derives an official iteration's accept length from its recorded logits and measures the margin of every
    decision on the target's path; ``worst`` is the smallest margin seen, ``where`` says which."""

    def __init__(self):
        self.worst, self.where, self.checked = float("inf"), None, 0
        self.off_top = 0  # iterations whose accepted path passes a code not its parent's top-1 (no chain drafts it)

    def note(self, margin: float, what: str) -> None:
        self.checked += 1
        if margin < self.worst:
            self.worst, self.where = margin, what

    def static(self, rows: list, choices: list, codes: list, accepted: int, tag: str) -> int:
        """A static tree (``topK_genrate_v1``): ``rows`` [root [1, V], then per depth d the nodes of depth d that have
        children, in sorted order]; ``codes`` the target's codes after the root. Returns the derived accept length
        (capped at ``len(codes)``), asserted equal to the official ``accepted`` (capped likewise)."""
        children, with_children = {}, {}
        for c in choices:
            children[tuple(c[:-1])] = children.get(tuple(c[:-1]), 0) + 1
        for c in sorted(choices, key=lambda x: (len(x), x)):
            if tuple(c) in children:
                with_children.setdefault(len(c), []).append(tuple(c))
        row = {(): rows[0][0]}
        for depth, nodes in with_children.items():
            for i, node in enumerate(nodes):
                row[node] = rows[depth][i]

        def shape(node):
            return tuple(shape(node + (r,)) for r in range(children.get(node, 0)))

        node, length, off_top = (), 0, False
        while length < len(codes) and children.get(node, 0):
            k, code = children[node], codes[length]
            r, ordered = rank_of(row[node], code)
            # a swap with a neighbouring rank matters where it moves the code in or out of the tree or under
            # another subtree
            if r < k and (r + 1 == k or shape(node + (r,)) != shape(node + (r + 1,))):
                self.note(float(ordered[r] - ordered[r + 1]), f"{tag}: rank {r} of {k} at {list(node)}")
            if 1 <= r <= k and (r == k or shape(node + (r - 1,)) != shape(node + (r,))):
                self.note(float(ordered[r - 1] - ordered[r]), f"{tag}: rank {r} of {k} at {list(node)}")
            if r >= k:
                break
            node, length, off_top = node + (r,), length + 1, off_top or r > 0
        self.off_top += off_top
        assert length == min(accepted, len(codes)), \
            f"{tag}: the static tree re-derived from the recorded logits accepts {length}, the official {accepted}"
        return length

    def dynamic(self, rows: list, top_k: int, depth: int, total: int, codes: list, accepted: int, tag: str,
                gaps: "BoundaryGaps") -> int:
        """A dynamic tree (``topK_genrate``): ``rows`` [root [1, V], then per expansion the K frontier nodes' [K, V]
        in topk order]; ``total`` the drafts kept (total_token - 1). Re-derives EAGLE-2's selection, the path of the
        target's codes through it and its accept length (asserted equal to the official one), noting the margin of
        each decision on that path; the selection boundaries go to ``gaps``."""
        logp = [r.log_softmax(-1) for r in rows]
        top = logp[0][0].topk(top_k)
        nodes = [{"parent": -1, "depth": 1, "code": int(c), "score": float(s), "row": None}
                 for c, s in zip(top.indices, top.values)]
        frontier = list(range(top_k))
        levels = {1: list(range(top_k))}
        for i in range(depth):
            for j, node in enumerate(frontier):
                nodes[node]["row"] = (i + 1, j)
            if i + 1 > len(rows) - 1:
                break
            top = logp[i + 1].topk(top_k, dim=-1)
            # the official score of a child: topk_p + scores[:, None], in the logits' dtype
            parent_scores = torch.tensor([nodes[node]["score"] for node in frontier], dtype=top.values.dtype)
            scores = (top.values + parent_scores[:, None]).flatten()
            first = len(nodes)
            for m, (code, score) in enumerate(zip(top.indices.flatten().tolist(), scores.tolist())):
                nodes.append({"parent": frontier[m // top_k], "depth": i + 2, "code": code, "score": score,
                              "row": None})
            levels[i + 2] = list(range(first, len(nodes)))
            chosen = scores.topk(top_k).indices
            gaps.boundary(scores, top_k, f"{tag}: frontier at depth {i + 2}")
            frontier = [first + int(m) for m in chosen]
        all_scores = torch.tensor([n["score"] for n in nodes], dtype=rows[0].dtype)
        kept = set(all_scores.topk(total).indices.tolist())
        gaps.boundary(all_scores, total, f"{tag}: the {total} kept")
        bound_in = float(all_scores.topk(total + 1).values[-1]) if len(nodes) > total else float("-inf")
        bound_out = float(all_scores.topk(total).values[-1])

        def selection(score: float, inside: bool) -> float:
            return score - bound_in if inside else bound_out - score

        node, length, off_top = None, 0, False  # None: the root
        while length < len(codes):
            code = codes[length]
            if node is None:
                r, ordered = rank_of(logp[0][0], code)
                parent_logp = ordered
            else:
                if nodes[node]["row"] is None:  # not expanded: was that a near call?
                    level = levels[nodes[node]["depth"]]
                    if nodes[node]["depth"] <= depth and nodes[node]["depth"] > 1:
                        level_scores = all_scores[level]
                        kth = float(level_scores.topk(top_k).values[-1])
                        self.note(kth - nodes[node]["score"], f"{tag}: node {node} not expanded")
                    break
                d, j = nodes[node]["row"]
                r, parent_logp = rank_of(logp[d][j], code)
                if nodes[node]["depth"] > 1:  # its expansion: in its depth's frontier
                    level_scores = all_scores[levels[nodes[node]["depth"]]]
                    if len(level_scores) > top_k:
                        self.note(nodes[node]["score"] - float(level_scores.topk(top_k + 1).values[-1]),
                                  f"{tag}: node {node} expanded")
            # the code among the node's top K children
            if r < top_k:
                self.note(float(parent_logp[r] - parent_logp[top_k]), f"{tag}: child rank {r}")
            else:
                self.note(float(parent_logp[top_k - 1] - parent_logp[r]), f"{tag}: child rank {r}")
                break
            child = next(m for m, n in enumerate(nodes) if n["parent"] == (-1 if node is None else node)
                         and n["code"] == code and (node is not None or n["depth"] == 1))
            inside = child in kept
            self.note(selection(nodes[child]["score"], inside), f"{tag}: node {child} kept={inside}")
            if not inside:
                break
            node, length, off_top = child, length + 1, off_top or r > 0
        self.off_top += off_top
        assert length == min(accepted, len(codes)), \
            f"{tag}: the dynamic tree re-derived from the recorded logits accepts {length}, the official {accepted}"
        return length


class BoundaryGaps:
    """The dynamic tree's selection boundaries (the K-th against the (K+1)-th score of each frontier, the 58th against
    the 59th of everything drafted): a near tie there changes which other nodes are drafted (not the target's path,
    whose own decisions PathMargins checks); counted, and covered by the shaken reruns."""

    def __init__(self):
        self.near, self.seen, self.worst = 0, 0, float("inf")

    def boundary(self, scores: torch.Tensor, k: int, what: str) -> None:
        if scores.numel() <= k:
            return
        values = scores.topk(k + 1).values
        gap = float(values[-2] - values[-1])
        self.seen += 1
        self.worst = min(self.worst, gap)
        self.near += gap <= TIE


@contextlib.contextmanager
def perturbed(cnets, drafter, seed: int):
    """The official drafter with its guided logits shaken by up to SHAKE (see DraftLogits)."""
    with DraftLogits(cnets, drafter, shake=SHAKE, seed=seed) as recorder:
        yield recorder


class Posterior:
    """Wraps an EaModel's evaluate_posterior and evaluate_posterior_v1 (instance attributes), keeping each call's
    accept length."""

    def __init__(self, model):
        self.model, self.accepts = model, []

    def __enter__(self):
        for name in ("evaluate_posterior", "evaluate_posterior_v1"):
            bound = getattr(self.model, name)

            def call(*args, _bound=bound, **kwargs):
                out = _bound(*args, **kwargs)
                self.accepts.append(int(out[1]))
                return out

            setattr(self.model, name, call)
        return self

    def __exit__(self, *exc):
        for name in ("evaluate_posterior", "evaluate_posterior_v1"):
            del self.model.__dict__[name]


def ea_model_run(model, cnets, generate, kind: str, code_ids: list, choices, margins=None, gaps=None, shake=None,
                 tag=""):
    """One official ``EaModel.generate`` (``generate(static_tree)``: the ids it returns, batch 1) with its drafter's
    trees recorded: the accept lengths; each iteration's re-derived accept length and path margins go to
    ``margins``/``gaps``, the tree of iteration k being the drafter's call k (the last call drafts a tree never
    verified). ``code_ids``: the target's greedy codes as the drafter's ids (the path the margins follow)."""
    recorder = perturbed(cnets, model.ea_layer, shake) if shake is not None else DraftLogits(cnets, model.ea_layer)
    with recorder as record, Posterior(model) as posterior, torch.no_grad():
        ids = generate(kind == "static")
    n = 1
    for k, accept in enumerate(posterior.accepts):
        if margins is not None:
            ahead = code_ids[n:n + DEPTH + 2]
            where = f"{tag} iteration {k + 1} at {n}"
            if kind == "static":
                margins.static(record.rows(k), choices, ahead, accept, where)
            else:
                margins.dynamic(record.rows(k), TOP_K, DEPTH, TOTAL_TOKEN - 1, ahead, accept, where, gaps)
        n += accept + 1
    assert len(record.calls) == len(posterior.accepts) + 1, "a draft call per iteration, and the prefill's"
    return ids, posterior.accepts
