"""CSpD: the trajectory-ratio rule proven exact on Gaussians (KS against the target), with the breaks it
must catch (the paper's and the reference's intermediate sigma factor, temperature 42, zero-filled
rejections); the sampler's schedule, call counts, self-draft identity and refusals on tiny MARs.

Whole runs against plain MAR (two-sample tests, and every kept draft standardised by the target's
Gaussian) are in test_cspd_whole_run.py.
"""
import copy
import math

import numpy as np
import pytest
import torch

from fastar.errors import FastARError
from fastar.model_loaders.mar.diffusion import ReverseStep
from fastar.model_loaders.shared.protocol import ClassConditioning
from fastar.samplers.masked_loops import continuous_acceptance as rule
from fastar.samplers.masked_loops.cspd import REFERENCE_TEMPERATURE, CSpDSettings, cspd_decode, merged_schedule
from fastar.samplers.masked_loops.masked import MaskedSettings, mask_schedule, masked_decode
from fastar.tests.test_mar import tiny_mar

def ks_normal(values: np.ndarray) -> float:
    """KS distance of ``values`` to N(0, 1) and its asymptotic p-value."""
    x = np.sort(values)
    cdf = 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
    n = len(x)
    d = max(np.max(np.arange(1, n + 1) / n - cdf), np.max(cdf - np.arange(n) / n))
    t = d * math.sqrt(n)
    p = 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * t * t) for k in range(1, 101))
    return float(min(max(p, 0.0), 1.0))


TARGET = tiny_mar(0)
DRAFT = copy.deepcopy(TARGET)
with torch.no_grad():
    DRAFT.head.final_layer.linear.bias[4:] += 0.005  # other stds at every reverse step
    DRAFT.class_emb.weight.add_(0.0005 * torch.randn(DRAFT.class_emb.weight.shape, generator=torch.Generator().manual_seed(1)))


SETTINGS = MaskedSettings(num_iter=5, cfg_scale=2.5, cfg_schedule="linear", diffusion_steps=6, temperature=0.7)


def speculate(log_ratio=rule.log_acceptance_ratio, residual=rule.sample_residual, n: int = 40000, seed: int = 3):
    """Standardised residuals against the target of the rule run on one draft per row: N(0, 1) iff exact.
    Target and draft are 2-channel Gaussians that overlap partly, as two MAR heads' last steps do."""
    target = ReverseStep(torch.full((n, 2), 0.3), torch.tensor([[1.0, 0.5]]).expand(n, 2))
    draft = ReverseStep(torch.zeros(n, 2), torch.tensor([[1.5, 0.4]]).expand(n, 2))
    g = torch.Generator().manual_seed(seed)
    x = draft.mean + draft.std * torch.randn(draft.mean.shape, generator=g)
    ok = torch.log(torch.rand(n, generator=g)) < log_ratio(x, target, draft)
    out = x.clone()
    out[~ok] = residual(ReverseStep(target.mean[~ok], target.std[~ok]),
                        ReverseStep(draft.mean[~ok], draft.std[~ok]), g, 64).values
    r = ((out - target.mean) / target.std).numpy()
    return min(ks_normal(r[:, 0]), ks_normal(r[:, 1])), ok.float().mean().item()


def test_the_rule_is_exact_on_gaussians():
    p, acceptance = speculate()
    assert 0.2 < acceptance < 0.95 and p > 1e-3, (p, acceptance)


def zero_filled(target, draft, generator, max_tries):
    return rule.Resampled(torch.zeros_like(target.mean), torch.ones(target.mean.shape[0], dtype=torch.long), 0)


BREAKS = {
    # the paper's prod_t sigma^q_t / sigma^p_t and the reference's inverse: a constant given the shared noise
    "paper sigma_q/sigma_p factor": dict(log_ratio=lambda x, p, q: rule.log_acceptance_ratio(x, p, q) + 0.7),
    "reference sigma_p/sigma_q factor": dict(log_ratio=lambda x, p, q: rule.log_acceptance_ratio(x, p, q) - 0.7),
    "temperature 42 in the last-step exponent": dict(
        log_ratio=lambda x, p, q: (rule.log_density(x, p) - rule.log_density(x, q)) / 42),
    "zero-filled rejections": dict(residual=zero_filled),
    "inverted ratio": dict(log_ratio=lambda x, p, q: -rule.log_acceptance_ratio(x, p, q)),
}


@pytest.mark.parametrize("name", BREAKS)
def test_each_break_is_detected(name):
    p, _ = speculate(**BREAKS[name])
    assert p < 1e-6, p


def test_residual_sampling_caps_its_tries_and_falls_back_to_the_target():
    n = 2000
    target = ReverseStep(torch.zeros(n, 1), torch.ones(n, 1))
    same = rule.sample_residual(target, target, torch.Generator().manual_seed(0), max_tries=5)
    assert same.fallbacks == n and bool((same.tries == 5).all())  # p = q: nothing to keep, every token falls back
    r = same.values[:, 0].numpy()
    assert ks_normal(r) > 1e-3 and not np.any(r == 0)  # plain target draws, never zeros
    far = rule.sample_residual(target, ReverseStep(torch.full((n, 1), 50.0), torch.ones(n, 1)),
                               torch.Generator().manual_seed(0), max_tries=5)
    assert far.fallbacks == 0 and bool((far.tries == 1).all())  # disjoint draft: the first proposal is kept


def test_a_self_draft_accepts_everything_and_equals_plain_mar_with_a_gaussian_last_step():
    # float64: in float32 the draft and verify passes (other batch shapes, so other CPU kernels on some
    # machines) differ by ~1e-6 in eps, which the last step's mean amplifies to a few std of its tiny Gaussian
    target, settings = copy.deepcopy(TARGET).double(), SETTINGS
    rows = ClassConditioning(torch.tensor([0, 3, 1]))
    plain, _ = masked_decode(target, rows, settings, generator=torch.Generator().manual_seed(8), gaussian_last_step=True)
    tokens, stats = cspd_decode(target, target, rows, settings, CSpDSettings(gamma=2),
                                generator=torch.Generator().manual_seed(8))
    assert stats.acceptance_rate == 1.0 and stats.resample_tries == 0
    assert torch.equal(tokens, plain)


def test_calls_follow_the_schedule():
    settings = MaskedSettings(num_iter=8, diffusion_steps=4)
    rows = ClassConditioning(torch.tensor([0, 1]))
    _, merged = cspd_decode(TARGET, DRAFT, rows, settings, CSpDSettings(gamma=3, prefill=0.25, verify="merged"),
                            generator=torch.Generator().manual_seed(0))
    assert merged.target_forwards == 2 + 2 and merged.drafter_forwards == 6  # pre-fill 2, then 3 + 3 steps merged
    schedule = merged_schedule(9, settings, CSpDSettings(gamma=3, prefill=0.25, verify="merged"))
    masked = mask_schedule(9, 8)  # [9, 8, 7, 6, 5, 4, 3, 1, 0]
    assert schedule == masked[:3] + [masked[5], masked[8]]  # steps 0, 1 alone; 2-4 and 5-7 each as one
    _, steps = cspd_decode(TARGET, DRAFT, rows, settings, CSpDSettings(gamma=3, prefill=0.25),
                           generator=torch.Generator().manual_seed(0))
    assert 2 + 2 <= steps.target_forwards <= 8  # never more target calls than plain MAR
    assert sum(sum(c) for c in zip(*steps.fixed_per_forward)) == 2 * 9


def test_refusals_say_what_to_do():
    rows = ClassConditioning(torch.tensor([0]))
    with pytest.raises(FastARError, match="gamma 0"):
        cspd_decode(TARGET, DRAFT, rows, MaskedSettings(num_iter=4), CSpDSettings(gamma=0), generator=torch.Generator())
    with pytest.raises(FastARError, match="pre-fill 1.0"):
        cspd_decode(TARGET, DRAFT, rows, MaskedSettings(num_iter=4), CSpDSettings(prefill=1.0), generator=torch.Generator())
    with pytest.raises(FastARError, match="num_iter 10: .* 1 to 9 steps"):
        cspd_decode(TARGET, DRAFT, rows, MaskedSettings(num_iter=10), CSpDSettings(), generator=torch.Generator())
    other = tiny_mar(3, classes=5)
    with pytest.raises(FastARError, match="draft MAR has 5 classes but the target has 4"):
        cspd_decode(TARGET, other, rows, MaskedSettings(num_iter=4), CSpDSettings(), generator=torch.Generator())
    from fastar.commands.bench.toy_model import ToyModel

    with pytest.raises(FastARError, match="CSpD drafts with a smaller MAR model; the drafter given is a toy token model"):
        cspd_decode(TARGET, ToyModel(), rows, MaskedSettings(num_iter=4), CSpDSettings(), generator=torch.Generator())


# -- the relaxed rule (cspd-relaxed): the reference code's, labelled relaxed, measured in the MAR bench ------------
def gaussians(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    target = ReverseStep(torch.randn(n, 3, generator=g), torch.rand(n, 3, generator=g) + 0.2,
                         torch.randn(n, generator=g))
    draft = ReverseStep(torch.randn(n, 3, generator=g), torch.rand(n, 3, generator=g) + 0.2,
                        torch.randn(n, generator=g))
    return target, draft, torch.randn(n, 3, generator=g)


def test_the_relaxation_is_the_reference_formula():
    target, draft, x = gaussians()
    assert torch.equal(rule.log_acceptance_ratio(x, target, draft, rule.Relaxation()),
                       rule.log_acceptance_ratio(x, target, draft))  # the defaults are the exact rule
    T = 42.0
    exponent = lambda g: -0.5 * (((x - g.mean) / g.std) ** 2).sum(-1) / T ** 2
    normaliser = torch.log(draft.std).sum(-1) - torch.log(target.std).sum(-1)  # the last step's, not tempered
    relaxed = rule.log_acceptance_ratio(x, target, draft, rule.Relaxation(T))
    assert torch.allclose(relaxed, exponent(target) - exponent(draft) + normaliser, atol=1e-6)
    with_path = rule.log_acceptance_ratio(x, target, draft, rule.Relaxation(T, path_factor=True))
    assert torch.allclose(with_path - relaxed, target.path_log_std - draft.path_log_std)  # sigma_p / sigma_q


def test_the_relaxed_rule_accepts_more_and_is_not_the_target():
    relaxed = lambda x, p, q: rule.log_acceptance_ratio(x, p, q, rule.Relaxation(REFERENCE_TEMPERATURE))
    p_exact, exact_acceptance = speculate()
    p_relaxed, relaxed_acceptance = speculate(log_ratio=relaxed)
    assert relaxed_acceptance > exact_acceptance + 0.1 and p_relaxed < 1e-6 < p_exact


def test_the_path_factor_sums_the_earlier_steps_log_stds():
    from fastar.samplers.masked_loops.masked import Guide, Plan

    rows = ClassConditioning(torch.tensor([0, 2]))
    settings = MaskedSettings(num_iter=4, diffusion_steps=3)
    plan = Plan.draw(TARGET, settings, 2, torch.Generator().manual_seed(0))
    guide = Guide(TARGET, rows, settings)
    positions = plan.positions(0)
    z = guide.conditions(torch.zeros(2, TARGET.cfg.num_tokens, TARGET.cfg.token_dim),
                         torch.zeros(2, TARGET.cfg.num_tokens, dtype=torch.bool))
    last = guide.last_step(*z, positions, plan, 1.0)
    assert last.path_log_std.shape == (positions.numel(),) and torch.isfinite(last.path_log_std).all()
    one_step = Guide(TARGET, rows, MaskedSettings(num_iter=4, diffusion_steps=1)).last_step(*z, positions, plan, 1.0)
    assert torch.equal(one_step.path_log_std, torch.zeros_like(one_step.path_log_std))  # no earlier step
    assert bool((last.path_log_std != 0).all())


def test_cspd_relaxed_runs_labelled_relaxed_and_cspd_stays_exact():
    from fastar.samplers.decoders import LOSSLESS, decode_masked

    rows = ClassConditioning(torch.tensor([0, 1]))
    settings = MaskedSettings(num_iter=6, diffusion_steps=4, cfg_scale=2.0)
    reference = CSpDSettings(gamma=3, ratio_temperature=42.0, path_factor=True, verify="merged")
    _, exact = decode_masked(TARGET, rows, settings, "cspd", seed=0, cspd=CSpDSettings(gamma=3, verify="merged"),
                             drafter=DRAFT)
    _, relaxed = decode_masked(TARGET, rows, settings, "cspd-relaxed", seed=0, cspd=reference, drafter=DRAFT)
    assert relaxed.decoder == "cspd-relaxed" and not LOSSLESS["cspd-relaxed"] and LOSSLESS["cspd"]
    assert relaxed.acceptance_rate >= exact.acceptance_rate and relaxed.settings["ratio_temperature"] == 42.0
    with pytest.raises(FastARError, match="cspd-relaxed"):
        decode_masked(TARGET, rows, settings, "cspd", seed=0, cspd=reference, drafter=DRAFT)
    with pytest.raises(FastARError, match="at 1 without it, it is cspd"):
        decode_masked(TARGET, rows, settings, "cspd-relaxed", seed=0, cspd=CSpDSettings(), drafter=DRAFT)
