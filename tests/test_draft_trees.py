"""Draft trees: their shapes, exact verification on trees (recursive rejection over siblings drawn without
replacement, or the drafter's top codes), and every token family's tree attention and accepted-path move against
plain chain forwards of each root-to-node path; drafters grow trees as they step chains."""
from dataclasses import replace

import pytest
import torch
from torch.testing import assert_close

from fastar.errors import FastARError
from fastar.model_loaders import load_ar_model
from fastar.model_loaders.drafters.loader import load_drafter
from fastar.model_loaders.shared.protocol import PromptConditioning
from fastar.samplers.decoders import DecoderSpec, decode
from fastar.samplers.token_loops import drafting, trees
from fastar.samplers.token_loops.trees import chain, static_tree
from fastar.tests.tiny_chameleon import hf_model as chameleon_model, write_anole_drafter, write_folder
from fastar.tests.tiny_janus import hf_model as janus_model, write_converted
from test_drafters import eagle_config, eagle_weights, write_drafter
from test_exact_distribution import (ALPHA, DRAFTER, GUIDED, MODEL, PLAIN, PROCESSING, WIDE, AcceptsTooOften,
                                     ResidualIsTarget, chi_square_p_value, conditioning, exact_for)
from tiny_llamagen import tiny_conditioning, tiny_model

# a small tree for the toy grids: three children at the root, two under the first, one under each of those
SMALL = ((3,), (2, 1, 0), (1, 1, 0))
SMALL_TREE = DecoderSpec("spec", tree="static", tree_shape="small")
WIDE_ROWS = 20000


@pytest.fixture(autouse=True)
def small_shape(monkeypatch):
    monkeypatch.setitem(trees.STATIC_SHAPES, "small", SMALL)


def test_lantern_plus_plus_tree_has_its_published_shape():
    tree = static_tree("lantern++57")
    assert tree.nodes == 57 and tree.levels == 5
    assert [len(tree.nodes_at(d)) for d in range(1, 6)] == [5, 13, 16, 14, 9]
    assert tree.children[0, 0].tolist() == [1, 2, 3, 4, 5]  # the root's children in rank order
    assert tree.children[0, 1].tolist() == [6, 7, 8, 9, -1]  # node 1's four, then none
    leaf = tree.nodes_at(5).start  # the first depth-5 node descends from the first child at every depth
    assert tree.ancestors[0, leaf].nonzero().flatten().tolist() == [0, 1, 6, 19, 35, leaf]


def test_a_chain_is_a_tree_of_one_child_per_node():
    tree = chain(3)
    assert tree.is_chain and tree.nodes == 3 and tree.siblings == 1
    assert tree.parent.tolist() == [[0, 0, 1, 2]] and tree.depth.tolist() == [[0, 1, 2, 3]]
    assert tree.ancestors[0].long().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]


def test_an_unknown_shape_is_refused_with_the_known_ones():
    with pytest.raises(FastARError, match="lantern\\+\\+57"):
        DecoderSpec("spec", tree="static", tree_shape="bushy").validate()


# -- exact on trees --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["small", "lantern++57"])
@pytest.mark.parametrize("drafts", ["sampled", "top"])
@pytest.mark.parametrize("settings", [PLAIN, GUIDED], ids=["no-cfg-no-topk", "cfg-topk"])
def test_spec_on_trees_is_exact(shape, drafts, settings):
    tokens, stats = decode(MODEL, conditioning(), settings, DecoderSpec("spec", tree="static", tree_shape=shape, drafts=drafts), seed=21,
                           drafter=DRAFTER)
    assert chi_square_p_value(tokens, exact_for(settings)) > ALPHA
    assert stats.settings["tree"] == shape and stats.drafted_tokens > stats.accepted_tokens > 0


@pytest.mark.parametrize("name", list(PROCESSING))
@pytest.mark.parametrize("spec", [SMALL_TREE, replace(SMALL_TREE, drafts="top"),
                                  replace(SMALL_TREE, decoder="lantern", lantern_k=3, lantern_delta=0.0),
                                  replace(SMALL_TREE, decoder="lantern", lantern_k=3, lantern_delta=0.0, drafts="top")],
                         ids=lambda s: s.decoder + ("-top" if s.drafts == "top" else ""))
def test_trees_are_exact_at_other_temperatures_and_with_top_p(name, spec):
    settings = PROCESSING[name]
    tokens, _ = decode(MODEL, conditioning(), settings, spec, seed=22, drafter=DRAFTER, codebook=MODEL.embeddings)
    assert chi_square_p_value(tokens, exact_for(settings)) > ALPHA


@pytest.mark.parametrize("drafts", ["sampled", "top"])
def test_lantern_plus_plus_at_lambda_one_is_exact_on_trees(drafts):
    spec = replace(SMALL_TREE, decoder="lantern", lantern_k=3, lantern_lambda=1.0, drafts=drafts)
    tokens, stats = decode(MODEL, conditioning(), GUIDED, spec, seed=27, drafter=DRAFTER, codebook=MODEL.embeddings)
    assert chi_square_p_value(tokens, exact_for(GUIDED)) > ALPHA and stats.settings["rule"] == "lantern++ (lambda 1)"


def test_lantern_plus_plus_relaxes_on_trees():
    spec = replace(SMALL_TREE, decoder="lantern", lantern_k=3, lantern_lambda=3.0)
    tokens, _ = decode(MODEL, conditioning(label=0), PLAIN, spec, seed=28, drafter=DRAFTER, codebook=MODEL.embeddings)
    assert chi_square_p_value(tokens, exact_for(PLAIN, label=0)) < ALPHA  # relaxed: measurably off the target


DYNAMIC = DecoderSpec("spec", tree="dynamic", tree_depth=3, tree_topk=3, tree_nodes=8)


@pytest.mark.parametrize("settings", [PLAIN, GUIDED, PROCESSING["T1.3-topp0.8"]], ids=["plain", "cfg-topk", "T1.3-topp"])
@pytest.mark.parametrize("decoder", ["spec", "lantern"])
def test_dynamic_trees_are_exact(settings, decoder):
    spec = replace(DYNAMIC, decoder=decoder, lantern_k=3, lantern_delta=0.0)
    tokens, stats = decode(MODEL, conditioning(), settings, spec, seed=25, drafter=DRAFTER, codebook=MODEL.embeddings)
    assert chi_square_p_value(tokens, exact_for(settings)) > ALPHA
    assert stats.settings["tree"] == "dynamic" and "drafts" not in stats.settings  # always the drafter's top codes


def test_deep_dynamic_trees_are_exact_on_a_wider_grid():
    model = WIDE[(2, 3)]
    spec = replace(DYNAMIC, tree_depth=5, tree_nodes=12)
    tokens, stats = decode(model, conditioning(rows=WIDE_ROWS), GUIDED, spec, seed=26,
                           drafter=speculative_drafter((2, 3)))
    assert chi_square_p_value(tokens, exact_for(GUIDED, model=model), model) > ALPHA


@pytest.mark.parametrize("grid", [(2, 3), (3, 2)])
def test_deep_trees_are_exact_on_wider_grids(grid):
    """Six tokens: paths of the 57-node tree reach depth 5, past a row's end."""
    model = WIDE[grid]
    drafter = speculative_drafter(grid)
    tokens, stats = decode(model, conditioning(rows=WIDE_ROWS), GUIDED, DecoderSpec("spec", tree="static"),
                           seed=23, drafter=drafter)
    assert chi_square_p_value(tokens, exact_for(GUIDED, model=model), model) > ALPHA
    assert max(max(row) for row in stats.fixed_per_forward) >= 4  # deep paths were accepted


def speculative_drafter(grid):
    from fastar.commands.bench.toy_model import ToyModel
    from fastar.model_loaders.drafters.small_ar import SmallARDrafter
    return SmallARDrafter(ToyModel(vocab=3, grid=grid, num_classes=2, scale=2.0, seed=9))


@pytest.mark.parametrize("broken", ["parents-q", "no-path-move", "residual-is-target", "accepts-too-often"])
def test_broken_tree_verification_is_detected(monkeypatch, broken):
    rule = None
    if broken == "parents-q":  # siblings drawn without replacement, each recorded with its parent's whole q
        body = drafting.DraftPick.body

        def parents_q(*args):
            codes, dists = body(*args)
            return codes, dists[..., :1, :].expand_as(dists)
        monkeypatch.setattr(drafting.DraftPick, "body", parents_q)
    elif broken == "no-path-move":
        from fastar.commands.bench.toy_model import ToySession
        monkeypatch.setattr(ToySession, "keep_path", lambda *a: None)
    else:
        rule = ResidualIsTarget() if broken == "residual-is-target" else AcceptsTooOften()
        monkeypatch.setattr("fastar.samplers.decoders.make_rule", lambda *a: rule)
    tokens, _ = decode(MODEL, conditioning(label=0), PLAIN, SMALL_TREE, seed=24, drafter=DRAFTER)
    assert chi_square_p_value(tokens, exact_for(PLAIN, label=0)) < ALPHA


# -- tree attention in every token family -------------------------------------------------------------------


def path_to(tree, node: int) -> list[int]:
    path = [node]
    while path[-1]:
        path.append(int(tree.parent[0, path[-1]]))
    return path[::-1]


def check_tree_forward(model, conditioning, cfg: bool, vocab: int, start=(5, 3), tolerance=1e-4):
    """Every node's outputs equal a chain forward of its root-to-node path; after the accepted path moves into
    place, the next forward sees what a chain of those tokens would have left."""
    tree = static_tree("lantern++57")
    B, M, W = conditioning.batch, tree.nodes, max(start)
    start = torch.tensor(start)
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, vocab, (B, model.grid[0] * model.grid[1]), generator=g)
    nodes = torch.cat([codes.gather(1, start[:, None]), torch.randint(0, vocab, (B, M), generator=g)], 1)

    def session():
        s = model.start(conditioning, cfg=cfg, max_window=M + 1)
        s.forward(codes[:, :W], torch.zeros(B, dtype=torch.long))
        return s

    tested = session()
    out = tested.forward_tree(nodes, start, tree.depth.expand(B, -1), tree.ancestors.expand(B, -1, -1))
    for leaf in [m for m in range(1, M + 1) if tree.children[0, m, 0] < 0]:
        path = path_to(tree, leaf)
        plain = session().forward(nodes[:, path], start)
        assert_close(out.take(torch.tensor([path] * B)).cond, plain.cond, atol=tolerance, rtol=tolerance)
        if cfg:
            assert_close(out.take(torch.tensor([path] * B)).uncond, plain.uncond, atol=tolerance, rtol=tolerance)

    path, accepted = path_to(tree, tree.nodes_at(4).start), torch.tensor([3, 1])  # rows keep different lengths
    tested.keep_path(start, torch.tensor([path[1:]] * B), accepted)
    chained = session()
    chained.forward(nodes[:, path], start)
    after = torch.randint(0, vocab, (B, 2), generator=g)
    want, got = chained.forward(after, start + accepted + 1), tested.forward(after, start + accepted + 1)
    assert_close(got.cond, want.cond, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("model_type", ["c2i", "t2i"])
def test_llamagen_verifies_trees_as_chains(model_type):
    model = tiny_model(model_type)
    check_tree_forward(model, tiny_conditioning(model), cfg=True, vocab=model.vocab_size)


@pytest.fixture(scope="module")
def anole(tmp_path_factory):
    reference = chameleon_model(seed=0)
    root = tmp_path_factory.mktemp("trees")
    drafter_folder = root / "anole_drafter"
    write_anole_drafter(drafter_folder, reference, seed=7)
    lumina = load_ar_model(write_folder(root / "tiny-lumina", reference, lumina=True, image_size=128))
    return load_ar_model(write_folder(root / "tiny-anole", reference, lumina=False, image_size=None)), drafter_folder, lumina


def test_anole_verifies_trees_as_chains(anole):
    model = anole[0]
    check_tree_forward(model, PromptConditioning(["a red ring on blue", "a square"]), cfg=True,
                       vocab=model.vocab_size, start=(4, 2))


def test_janus_verifies_trees_as_chains(tmp_path):
    model = load_ar_model(write_converted(tmp_path / "tiny-janus", janus_model(seed=0)))
    check_tree_forward(model, PromptConditioning(["a red ring", "a green square on white"]), cfg=True,
                       vocab=model.vocab_size, start=(4, 2))


@pytest.mark.parametrize("start", [(5, 3), (7, 6)], ids=["crossing-a-row-end", "from-a-row-end"])
def test_lumina_verifies_trees_as_chains_with_its_row_ends(anole, start):
    """Lumina-mGPT ends each row with a token: a tree carries it after every node that ends a row (the root's own
    when it ends one), and the accepted path keeps the row ends it crosses."""
    lumina = anole[2]
    assert lumina.layout.row_end is not None and lumina.grid[1] == 8
    check_tree_forward(lumina, PromptConditioning(["a red ring on blue", "a square"]), cfg=True,
                       vocab=lumina.vocab_size, start=start)


# -- drafters grow trees as they step chains ----------------------------------------------------------------


def check_grow(drafter, target, conditioning, vocab: int, tolerance, n=(4, 3)):
    """A drafter's outputs at each node of a grown tree equal stepping it along the node's path."""
    tree = static_tree("small")
    B = conditioning.batch
    g = torch.Generator().manual_seed(11)
    codes = torch.randint(0, vocab, (B, target.grid[0] * target.grid[1]), generator=g)
    n = torch.tensor(n)
    nodes = torch.randint(0, vocab, (B, tree.nodes + 1), generator=g)

    def caught_up():
        session = target.start(conditioning, cfg=True, max_window=16, hidden=drafter.needs_target_hidden)
        out = session.forward(codes[:, :max(n) + 1], torch.zeros(B, dtype=torch.long))
        drafting = drafter.start(conditioning, cfg=True, max_window=4, target_session=session, tree_nodes=tree.nodes)
        drafting.catch_up(codes, n, out, torch.full((B,), -1))
        return drafting

    growing, grown = caught_up(), {}
    for depth in (1, 2):
        kids = tree.nodes_at(depth)
        sl = slice(kids.start, kids.stop)
        out = growing.grow(nodes[:, sl], n - 1, tree.depth.expand(B, -1), tree.ancestors[:, sl].expand(B, -1, -1),
                           tree.parent[:, sl].expand(B, -1), kids.start)
        grown.update({m: out.take(torch.full((B, 1), m - kids.start)) for m in kids})
    for m, out in grown.items():
        stepping = caught_up()
        for depth, node in enumerate(path_to(tree, m)[1:]):
            stepped = stepping.step(nodes[:, node:node + 1], n + depth)
        assert_close(out.cond, stepped.cond, atol=tolerance, rtol=tolerance)
        assert_close(out.uncond, stepped.uncond, atol=tolerance, rtol=tolerance)


def test_an_eagle_drafter_grows_trees_as_it_steps(tmp_path):
    target = tiny_model("c2i")
    drafter = load_drafter(write_drafter(tmp_path / "d", eagle_weights(), eagle_config()), target)
    check_grow(drafter, target, tiny_conditioning(target), target.vocab_size, 1e-4)


def test_the_anole_drafter_grows_trees_as_it_steps(anole):
    model, folder, _ = anole
    check_grow(load_drafter(folder, model), model, PromptConditioning(["a red ring", "a blue square"]),
               model.vocab_size, 1e-4)


def test_a_small_ar_drafter_grows_trees_as_it_steps():
    from fastar.model_loaders.drafters.small_ar import SmallARDrafter
    target = tiny_model("c2i")
    check_grow(SmallARDrafter(tiny_model("c2i", seed=4)), target, tiny_conditioning(target), target.vocab_size, 1e-4)


def test_a_small_drafter_grows_trees_across_lumina_row_ends(anole):
    """Roots at a row's end and children ending a row: the drafter's catch-up leaves the root's row end where the
    tree's nodes see it."""
    from fastar.model_loaders.drafters.small_ar import SmallARDrafter
    lumina = anole[2]
    check_grow(SmallARDrafter(lumina), lumina, PromptConditioning(["a red ring", "a blue square"]), lumina.vocab_size,
               1e-4, n=(8, 7))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_trees_run_in_half_precision_with_codes_in_range(dtype, tree):
    """A GPU's dtypes, emulated on the CPU: the target and its drafter in half precision, CFG, batch 2."""
    from fastar.model_loaders.drafters.small_ar import SmallARDrafter
    from fastar.samplers.processing import SamplingSettings
    target, draft = tiny_model("c2i").to(dtype), tiny_model("c2i", seed=4).to(dtype)
    codes, stats = decode(target, tiny_conditioning(target), SamplingSettings(cfg_scale=2.0, top_k=20),
                          DecoderSpec("spec", tree=tree, tree_depth=3, tree_topk=4, tree_nodes=10), seed=3,
                          drafter=SmallARDrafter(draft))
    assert codes.shape == (2, 16) and 0 <= codes.min() and codes.max() < target.vocab_size
    assert stats.target_forwards < 15 and stats.accepted_tokens > 0
