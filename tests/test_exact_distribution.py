"""Lossless decoders must sample exactly the plain-AR distribution (bench.md, "Fidelity").

On enumerable toy models (3 codes on 2x2, 2x3 and 3x2 grids: 81 or 729 sequences) we draw many rows in
one batch (which also proves every row of a batch is exactly distributed) and run a chi-square test
against the exact joint probabilities computed by enumeration. On the 2x2 grid every slot that is
initialised after the first iteration lies past the last token, so initialisation is only tested on the
wider grids, where windows of 3-4 reach past the row. Deliberately broken acceptance rules, drafts
recorded with the wrong distribution and tempered drafts recorded untempered must all fail.
"""
from functools import lru_cache

import pytest
import torch

from fastar.model_loaders.drafters.small_ar import SmallARDrafter
from fastar.model_loaders.shared.protocol import ClassConditioning, ModelOutput
from fastar.samplers.token_loops import drafting, jacobi
from fastar.samplers.token_loops.acceptance import ExactRule
from fastar.samplers.decoders import DecoderSpec, decode, make_generator
from fastar.samplers.token_loops.drafts import COUPLINGS, INIT_STRATEGIES, DraftSource
from fastar.samplers.token_loops.jacobi import jacobi_decode
from fastar.samplers.processing import SamplingSettings, probabilities, sample
from fastar.samplers.token_loops.drafting import TreeSettings
from fastar.samplers.token_loops.speculative import speculative_decode
from fastar.commands.bench.toy_model import ToyModel

ROWS = 12000
ALPHA = 1e-4  # false-alarm rate per test; the broken rules below land far beyond it

MODEL = ToyModel(vocab=3, grid=(2, 2), num_classes=2, scale=2.0, seed=0)
# an unrelated toy of the same shape: a poor drafter, so rejections and residuals happen often
DRAFTER = SmallARDrafter(ToyModel(vocab=3, grid=(2, 2), num_classes=2, scale=2.0, seed=7))
GUIDED = SamplingSettings(cfg_scale=2.0, top_k=2)
PLAIN = SamplingSettings(cfg_scale=1.0, top_k=0)
# wider grids: windows of 3-4 reach past the end of a row, so freshly initialised drafts get verified
WIDE = {grid: ToyModel(vocab=3, grid=grid, num_classes=2, scale=2.0, seed=3) for grid in ((2, 3), (3, 2))}
WIDE_ROWS = 20000
# temperatures other than 1 and nucleus sampling, each with guidance
PROCESSING = {
    "T0.7": SamplingSettings(cfg_scale=2.0, temperature=0.7),
    "T1.3-topk2": SamplingSettings(cfg_scale=2.0, temperature=1.3, top_k=2),
    "T1.3-topp0.8": SamplingSettings(cfg_scale=1.5, temperature=1.3, top_p=0.8),
}


def chi_square_p_value(tokens: torch.Tensor, exact: torch.Tensor, model=MODEL) -> float:
    observed = torch.bincount(model.index_of(tokens), minlength=len(exact)).double()
    expected = exact * tokens.shape[0]
    assert observed[expected == 0].sum() == 0, "sampled a sequence of probability zero"
    # cells expected fewer than 5 times are pooled into one, where the chi-square law holds
    rare = (expected > 0) & (expected < 5)
    common = expected >= 5
    observed = torch.cat([observed[common], observed[rare].sum().view(1)])
    expected = torch.cat([expected[common], expected[rare].sum().view(1)])
    cells = expected > 0
    stat = ((observed[cells] - expected[cells]) ** 2 / expected[cells]).sum()
    dof = int(cells.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2.0))


def conditioning(label=1, rows=ROWS):
    return ClassConditioning(torch.full((rows,), label, dtype=torch.long))


def exact_for(settings: SamplingSettings, label=1, model=MODEL):
    return exact_joint(model, settings, label)


@lru_cache(maxsize=None)
def exact_joint(model, settings: SamplingSettings, label: int) -> torch.Tensor:
    return model.exact_joint(label, cfg_scale=settings.cfg_scale, temperature=settings.temperature,
                             top_k=settings.top_k, top_p=settings.top_p)


def test_plain_ar_is_exact():
    tokens, stats = decode(MODEL, conditioning(), GUIDED, DecoderSpec("ar"), seed=0)
    assert stats.target_forwards == 3
    assert chi_square_p_value(tokens, exact_for(GUIDED)) > ALPHA


@pytest.mark.parametrize("init", INIT_STRATEGIES)
@pytest.mark.parametrize("coupling", COUPLINGS)
def test_sjd_is_exact_for_every_init_and_coupling(init, coupling):
    spec = DecoderSpec("sjd", window=3, init=init, coupling=coupling)
    tokens, _ = decode(MODEL, conditioning(), GUIDED, spec, seed=1)
    assert chi_square_p_value(tokens, exact_for(GUIDED)) > ALPHA


# windows of 3 and 4 tokens: drafts up to a row wide on 2x3, one past the row on 3x2
@pytest.mark.parametrize("grid,window", [((2, 3), 3), ((2, 3), 4), ((3, 2), 4)], ids=["2x3-w3", "2x3-w4", "3x2-w4"])
@pytest.mark.parametrize("init", INIT_STRATEGIES)
@pytest.mark.parametrize("coupling", COUPLINGS)
def test_sjd_is_exact_when_fresh_drafts_are_verified(grid, window, init, coupling):
    model = WIDE[grid]
    spec = DecoderSpec("sjd", window=window, init=init, coupling=coupling)
    tokens, _ = decode(model, conditioning(rows=WIDE_ROWS), GUIDED, spec, seed=window)
    assert chi_square_p_value(tokens, exact_for(GUIDED, model=model), model) > ALPHA


class RecordsTheWrongSlot(DraftSource):
    """Broken: sample-left drafts drawn from the last slot's p but recorded with the slot before it."""

    def record(self, positions, p):
        super().record(positions, p)
        if p.shape[1] > 1:  # a window, not the prefill's first distribution
            self.window_p = p

    def initial(self, seq, start, carried, p_last, noise=None):
        x, q = super().initial(seq, start, carried, p_last, noise)
        if hasattr(self, "window_p"):
            q = self.window_p[:, -2:-1].expand_as(q)
        return x, q


def test_fresh_drafts_recorded_with_the_wrong_distribution_are_detected(monkeypatch):
    monkeypatch.setattr(jacobi, "DraftSource", RecordsTheWrongSlot)
    model = WIDE[(2, 3)]
    spec = DecoderSpec("sjd", window=4, init="sample-left")
    tokens, _ = decode(model, conditioning(rows=WIDE_ROWS), GUIDED, spec, seed=4)
    assert chi_square_p_value(tokens, exact_for(GUIDED, model=model), model) < ALPHA


@pytest.mark.parametrize("name", list(PROCESSING))
@pytest.mark.parametrize("spec", [
    DecoderSpec("ar"), DecoderSpec("sjd", window=3, init="sample-left", coupling="maximal"),
    DecoderSpec("gsd", window=4, group=1, init="sample-above"), DecoderSpec("spec", gamma=2),
    DecoderSpec("spec", gamma=2, drafts="top"), DecoderSpec("lantern", gamma=3, lantern_k=3, lantern_delta=0.0),
    DecoderSpec("lantern", gamma=2, lantern_k=3, lantern_delta=0.0, drafts="top"),
], ids=lambda s: s.decoder + ("-top" if s.drafts == "top" else ""))
def test_lossless_decoders_are_exact_at_other_temperatures_and_with_top_p(name, spec):
    settings = PROCESSING[name]
    tokens, _ = decode(MODEL, conditioning(), settings, spec, seed=13, drafter=DRAFTER if spec.decoder in
                       ("spec", "lantern") else None, codebook=MODEL.embeddings)
    assert chi_square_p_value(tokens, exact_for(settings)) > ALPHA


def untempered_draft(pick, noise, cond, uncond):
    """Broken: a draft sampled from the tempered q but recorded with the drafter's untempered distribution."""
    out = ModelOutput(cond, uncond)
    q = probabilities(out, pick.pipeline)
    untempered = probabilities(out, SamplingSettings(cfg_scale=pick.pipeline.cfg_scale))
    return sample(q, noise).unsqueeze(-1), untempered.unsqueeze(-2)


def top_draft_recorded_as_drawn(pick, noise, cond, uncond):
    """Broken: the drafter's most likely code drafted, but recorded with the distribution q it was taken from."""
    q = probabilities(ModelOutput(cond, uncond), pick.pipeline)
    return q.argmax(-1, keepdim=True), q.unsqueeze(-2)


@pytest.mark.parametrize("settings", [PLAIN, GUIDED], ids=["no-cfg-no-topk", "cfg-topk"])
@pytest.mark.parametrize("gamma", [1, 3])
def test_top_drafts_are_exact(settings, gamma):
    tokens, stats = decode(MODEL, conditioning(), settings, DecoderSpec("spec", gamma=gamma, drafts="top"), seed=15,
                           drafter=DRAFTER)
    assert chi_square_p_value(tokens, exact_for(settings)) > ALPHA and stats.settings["drafts"] == "top"


def test_top_drafts_recorded_with_the_drafters_distribution_are_detected(monkeypatch):
    monkeypatch.setattr(drafting.DraftPick, "body", top_draft_recorded_as_drawn)
    tokens, _ = decode(MODEL, conditioning(), GUIDED, DecoderSpec("spec", gamma=2, drafts="top"), seed=15,
                       drafter=DRAFTER)
    assert chi_square_p_value(tokens, exact_for(GUIDED)) < ALPHA


def test_tempered_drafts_recorded_untempered_are_detected(monkeypatch):
    monkeypatch.setattr(drafting.DraftPick, "body", untempered_draft)
    settings = PROCESSING["T1.3-topk2"]
    tokens, _ = decode(MODEL, conditioning(), settings, DecoderSpec("spec", gamma=2), seed=14, drafter=DRAFTER)
    assert chi_square_p_value(tokens, exact_for(settings)) < ALPHA


@pytest.mark.parametrize("settings", [PLAIN, GUIDED], ids=["no-cfg-no-topk", "cfg-topk"])
@pytest.mark.parametrize("window", [2, 4, 16])
def test_sjd_is_exact_with_and_without_guidance(settings, window):
    # window 4 = all remaining tokens in one forward; 16 is clipped to the 4-token grid
    spec = DecoderSpec("sjd", window=window, init="horizontal", coupling="maximal")
    tokens, _ = decode(MODEL, conditioning(label=0), settings, spec, seed=2)
    assert chi_square_p_value(tokens, exact_for(settings, label=0)) > ALPHA


def test_gsd_with_group_one_is_exact_and_equals_sjd():
    gsd = DecoderSpec("gsd", window=3, group=1, init="sample-left")
    sjd = DecoderSpec("sjd", window=3, init="sample-left")
    tokens, _ = decode(MODEL, conditioning(), GUIDED, gsd, seed=3)
    assert chi_square_p_value(tokens, exact_for(GUIDED)) > ALPHA
    same_seed_sjd, _ = decode(MODEL, conditioning(rows=64), GUIDED, sjd, seed=4)
    same_seed_gsd, _ = decode(MODEL, conditioning(rows=64), GUIDED, gsd, seed=4)
    assert torch.equal(same_seed_sjd, same_seed_gsd)


def test_gsd_with_large_groups_is_relaxed():
    """GSD trades fidelity for speed: with an unfiltered cluster covering the vocabulary it accepts
    every draft, which the test must see."""
    spec = DecoderSpec("gsd", window=4, group=3, prob_threshold=1.0, distance_threshold=1.0)
    tokens, stats = decode(MODEL, conditioning(), GUIDED, spec, seed=5)
    assert chi_square_p_value(tokens, exact_for(GUIDED)) < ALPHA
    _, sjd_stats = decode(MODEL, conditioning(), GUIDED, DecoderSpec("sjd", window=4), seed=5)
    assert stats.tokens_per_forward > sjd_stats.tokens_per_forward + 0.3


class ResidualIsTarget(ExactRule):
    """Broken: resample from p instead of norm([p - q]_+) after a rejection."""

    def residual(self, p, q, x):
        return p


class IgnoresDraftProbability(ExactRule):
    """Broken: accept with p(x) regardless of q(x)."""

    def accept_probability(self, p, q, x):
        return super().accept_probability(p, torch.ones_like(q), x)


class AcceptsTooOften(ExactRule):
    """Broken: a mild over-acceptance (ratio ** 0.7)."""

    def accept_probability(self, p, q, x):
        return super().accept_probability(p, q, x) ** 0.7


BROKEN = [
    (ResidualIsTarget(), "random"),
    (ResidualIsTarget(), "horizontal"),
    (AcceptsTooOften(), "sample-left"),
    (AcceptsTooOften(), "vertical"),
    # with one-hot (copied) drafts q(x) = 1, so ignoring q only shows on sampled drafts
    (IgnoresDraftProbability(), "random"),
]


@pytest.mark.parametrize("rule,init", BROKEN, ids=[f"{type(r).__name__}-{i}" for r, i in BROKEN])
def test_broken_acceptance_rules_are_detected(rule, init):
    tokens, _ = jacobi_decode(MODEL, conditioning(), GUIDED, generator=make_generator(6, "cpu"),
                              window=3, init=init, rule=rule)
    assert chi_square_p_value(tokens, exact_for(GUIDED)) < ALPHA


@pytest.mark.parametrize("gamma", [1, 2, 3, 8])
@pytest.mark.parametrize("settings", [PLAIN, GUIDED], ids=["no-cfg-no-topk", "cfg-topk"])
def test_speculative_decoding_with_a_drafter_is_exact(gamma, settings):
    # gamma 3 drafts every remaining token in one forward; 8 is clipped to the grid
    spec = DecoderSpec("spec", gamma=gamma)
    tokens, stats = decode(MODEL, conditioning(), settings, spec, seed=7, drafter=DRAFTER)
    assert chi_square_p_value(tokens, exact_for(settings)) > ALPHA
    assert stats.drafter_forwards == min(gamma, 3) * stats.target_forwards


@pytest.mark.parametrize("rule", [ResidualIsTarget(), AcceptsTooOften()],
                         ids=lambda r: type(r).__name__)
def test_broken_rules_are_detected_with_a_drafter(rule):
    tokens, _ = speculative_decode(MODEL, DRAFTER, conditioning(), GUIDED, generator=make_generator(8, "cpu"),
                                   tree=TreeSettings(gamma=2), rule=rule)
    assert chi_square_p_value(tokens, exact_for(GUIDED)) < ALPHA


def test_lantern_with_zero_delta_is_exact_speculative_decoding():
    lantern = DecoderSpec("lantern", gamma=2, lantern_k=3, lantern_delta=0.0)
    tokens, _ = decode(MODEL, conditioning(), GUIDED, lantern, seed=9, drafter=DRAFTER, codebook=MODEL.embeddings)
    assert chi_square_p_value(tokens, exact_for(GUIDED)) > ALPHA
    few = conditioning(rows=64)
    spec_tokens, _ = decode(MODEL, few, GUIDED, DecoderSpec("spec", gamma=2), seed=10, drafter=DRAFTER)
    lantern_tokens, _ = decode(MODEL, few, GUIDED, lantern, seed=10, drafter=DRAFTER, codebook=MODEL.embeddings)
    assert torch.equal(spec_tokens, lantern_tokens)


def test_lantern_on_jacobi_drafts_with_zero_delta_is_exact():
    spec = DecoderSpec("lantern", window=3, init="sample-left", lantern_k=3, lantern_delta=0.0)
    tokens, _ = decode(MODEL, conditioning(), GUIDED, spec, seed=11, codebook=MODEL.embeddings)
    assert chi_square_p_value(tokens, exact_for(GUIDED)) > ALPHA


def test_lantern_with_a_large_budget_is_relaxed_and_accepts_more():
    relaxed = DecoderSpec("lantern", gamma=3, lantern_k=3, lantern_delta=0.9)
    tokens, stats = decode(MODEL, conditioning(), PLAIN, relaxed, seed=12, drafter=DRAFTER, codebook=MODEL.embeddings)
    assert chi_square_p_value(tokens, exact_for(PLAIN)) < ALPHA
    _, exact_stats = decode(MODEL, conditioning(), PLAIN, DecoderSpec("spec", gamma=3), seed=12, drafter=DRAFTER)
    assert stats.tokens_per_forward > exact_stats.tokens_per_forward + 0.2


def test_greedy_decoders_reproduce_plain_greedy_decoding():
    """At temperature 0 exact speculative decoding and LANTERN with delta 0 give AR's greedy tokens."""
    greedy = SamplingSettings(cfg_scale=2.0, temperature=0.0)
    rows = conditioning(rows=2)
    ar_tokens, _ = decode(MODEL, rows, greedy, DecoderSpec("ar"), seed=0)
    for spec in (DecoderSpec("spec", gamma=3), DecoderSpec("lantern", gamma=3, lantern_k=3, lantern_delta=0.0)):
        tokens, _ = decode(MODEL, rows, greedy, spec, seed=1, drafter=DRAFTER, codebook=MODEL.embeddings)
        assert torch.equal(tokens, ar_tokens)


def test_entropy_aware_acceptance_at_strength_zero_is_sjd_and_at_one_is_relaxed():
    """sjd-entropy's strength 0 is SJD draw for draw (so exact); at the paper's strength 1 a confident target keeps
    drafts it should have rejected, which the test must see (the wide grid: windows reach past the row)."""
    model, settings = WIDE[(2, 3)], GUIDED
    exact = DecoderSpec("sjd-entropy", window=3, init="random", entropy_strength=0.0)
    sjd = DecoderSpec("sjd", window=3, init="random")
    same_seed_sjd, _ = decode(model, conditioning(rows=64), settings, sjd, seed=4)
    same_seed_entropy, _ = decode(model, conditioning(rows=64), settings, exact, seed=4)
    assert torch.equal(same_seed_sjd, same_seed_entropy)
    relaxed = DecoderSpec("sjd-entropy", window=3, init="random", entropy_strength=1.0)
    tokens, stats = decode(model, conditioning(rows=WIDE_ROWS), settings, relaxed, seed=5)
    assert chi_square_p_value(tokens, exact_for(settings, model=model), model) < ALPHA
    _, sjd_stats = decode(model, conditioning(rows=WIDE_ROWS), settings, sjd, seed=5)
    assert stats.tokens_per_forward > sjd_stats.tokens_per_forward + 0.05


@pytest.mark.filterwarnings("ignore:LANTERN without a drafter")  # deliberately on Jacobi drafts here
@pytest.mark.parametrize("decoder,drafted", [("lantern", True), ("lantern", False), ("gsd", True), ("gsd", False),
                                             ("sjd-entropy", False)],
                         ids=["lantern-drafter", "lantern-jacobi", "gsd-drafter", "gsd-jacobi", "sjd-entropy"])
def test_relaxed_decoders_never_emit_codes_that_top_k_removed(decoder, drafted):
    """Relaxed decoders may shift probability, but never onto codes outside the target's support."""
    toy = ToyModel(vocab=6, grid=(1, 3), num_classes=1, scale=1.5, seed=0)
    drafter = SmallARDrafter(ToyModel(vocab=6, grid=(1, 3), num_classes=1, scale=1.5, seed=1))
    settings = SamplingSettings(cfg_scale=2.0, top_k=3)
    spec = DecoderSpec(decoder, window=3, gamma=2, lantern_k=6, lantern_delta=0.3, group=5, prob_threshold=1.0,
                       distance_threshold=1.0)
    tokens, _ = decode(toy, ClassConditioning(torch.zeros(20000, dtype=torch.long)), settings, spec, seed=15,
                       drafter=drafter if drafted else None, codebook=toy.code_embeddings())
    support = toy.exact_joint(0, cfg_scale=2.0, top_k=3) > 0
    assert support[toy.index_of(tokens)].all()
