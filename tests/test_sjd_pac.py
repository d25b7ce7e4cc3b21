"""SJD-PAC (samplers/token_loops/proactive.py): its window tree, and exactness on the enumerable toy models for every
initialisation and coupling, at other temperatures and with top-p, with CFG, every row of a large batch; siblings
recorded with the wrong distribution are detected."""
import pytest
import torch

from fastar.errors import FastARError
from fastar.samplers.decoders import DecoderSpec, decode
from fastar.samplers.processing import sample
from fastar.samplers.token_loops import jacobi, proactive
from fastar.samplers.token_loops.drafts import COUPLINGS, INIT_STRATEGIES
from fastar.samplers.token_loops.proactive import PacIteration, PacSettings, pac_shape
from test_exact_distribution import (ALPHA, GUIDED, MODEL, PROCESSING, WIDE, WIDE_ROWS, chi_square_p_value,
                                     conditioning, exact_for)

# (window, branches, depth): on the 2x3 and 3x2 toys, branched depths, a chain after them, fresh drafts verified
SHAPES = [(8, 2, 3), (5, 3, 2)]


def test_the_window_tree_branches_its_first_depths_and_chains_the_rest():
    shape = pac_shape(PacSettings(window=32, branches=3, depth=3), tokens=256, device="cpu")
    tree = shape.tree
    assert tree.nodes == 31 and shape.main == 21  # 3 + 9 branched nodes, then the main chain on to depth 21
    assert [len(tree.nodes_at(d)) for d in range(1, 5)] == [3, 9, 1, 1]
    assert tree.nodes_at(3)[0] in tree.children[0, tree.nodes_at(2)[0]].tolist()  # the chain hangs off the main node
    side_leaf = tree.nodes_at(2)[-1]
    follow = shape.follow[side_leaf].tolist()
    assert follow[0] == side_leaf and follow[1] == tree.nodes_at(3)[0]  # a side leaf continues on the main chain
    assert shape.rank[tree.nodes_at(2)].tolist() == [0, 1, 2] * 3


def test_a_window_too_small_for_its_tree_is_refused_with_the_smallest_that_fits():
    with pytest.raises(FastARError, match="window of at least 14"):
        DecoderSpec("sjd-pac", window=12, pac_branches=3, pac_depth=3).validate()


@pytest.mark.parametrize("grid", [(2, 3), (3, 2)], ids=["2x3", "3x2"])
@pytest.mark.parametrize("window,branches,depth", SHAPES, ids=[f"w{w}-k{k}-d{d}" for w, k, d in SHAPES])
@pytest.mark.parametrize("init", INIT_STRATEGIES)
@pytest.mark.parametrize("coupling", COUPLINGS)
def test_sjd_pac_is_exact_for_every_init_and_coupling(grid, window, branches, depth, init, coupling):
    model = WIDE[grid]
    spec = DecoderSpec("sjd-pac", window=window, init=init, coupling=coupling, pac_branches=branches, pac_depth=depth)
    tokens, stats = decode(model, conditioning(rows=WIDE_ROWS), GUIDED, spec, seed=window + branches)
    assert stats.settings["pac_branches"] == branches
    assert chi_square_p_value(tokens, exact_for(GUIDED, model=model), model) > ALPHA


@pytest.mark.parametrize("name", list(PROCESSING))
def test_sjd_pac_is_exact_at_other_temperatures_and_with_top_p(name):
    settings = PROCESSING[name]
    spec = DecoderSpec("sjd-pac", window=5, pac_branches=3, pac_depth=2, coupling="maximal", init="sample-left")
    tokens, _ = decode(MODEL, conditioning(), settings, spec, seed=17)
    assert chi_square_p_value(tokens, exact_for(settings)) > ALPHA


class SiblingsRecordedAsTheFirst(PacIteration):
    """Broken: siblings drawn without replacement, but recorded with the first candidate's q."""

    def assemble(self, first, first_q, noise):
        K, main, branched = self.shape.branches, self.shape.main, self.shape.branched
        codes, q = [first], first_q[:, :branched]
        for _ in range(1, K):
            q = proactive.without_drawn(q, codes[-1][:, :branched], first_q[:, :branched])
            codes.append(torch.cat([sample(q, noise), first[:, branched:]], 1))
        codes = torch.stack(codes, 1).flatten(1, 2)
        node = (self.shape.rank * main + self.tree.depth[0] - 1)[1:]
        return codes[:, node], first_q.repeat(1, K, 1)[:, node]


def test_siblings_recorded_with_the_wrong_distribution_are_detected(monkeypatch):
    monkeypatch.setattr(jacobi, "PacIteration", SiblingsRecordedAsTheFirst)
    model = WIDE[(2, 3)]
    spec = DecoderSpec("sjd-pac", window=5, pac_branches=3, pac_depth=2, coupling="maximal")
    tokens, _ = decode(model, conditioning(rows=WIDE_ROWS), GUIDED, spec, seed=3)
    assert chi_square_p_value(tokens, exact_for(GUIDED, model=model), model) < ALPHA


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("init", ["random", "sample-above"])
def test_sjd_pac_runs_in_half_precision_with_codes_in_range(dtype, init):
    """A GPU's dtypes, emulated on the CPU: CFG, top-k, batch 2, each coupling."""
    from fastar.samplers.processing import SamplingSettings
    from tiny_llamagen import tiny_conditioning, tiny_model

    target = tiny_model("c2i").to(dtype)
    for coupling in COUPLINGS:
        spec = DecoderSpec("sjd-pac", window=10, init=init, coupling=coupling)
        codes, stats = decode(target, tiny_conditioning(target), SamplingSettings(cfg_scale=2.0, top_k=20), spec, seed=3)
        assert codes.shape == (2, 16) and 0 <= codes.min() and codes.max() < target.vocab_size
        assert stats.target_forwards < 15
