"""Whole CSpD runs against plain MAR: two-sample KS tests on per-image statistics (a projection of the
tokens: its mean, at fixed positions, products of raster and vertical neighbours; token norms).

- ``steps`` verification against plain MAR (its last reverse step kept Gaussian) at the same num_iter, cfg
  schedule and temperature;
- ``merged`` verification against plain MAR on the merged schedule (each draft round as one step), which
  the test also tells apart from plain MAR at num_iter;
- in both modes, every kept drafted token standardised by the target's last-step Gaussian it was verified
  with: i.i.d. N(0, 1) iff exact, which catches the breaks: the paper's and the reference's intermediate
  sigma factor, the reference's temperature 42 in the last-step exponent, zero-filled rejections.

The models are tiny random MARs in float64. Random heads are far from exact at t = 999, which the first
reverse step amplifies about 300-fold, so their tokens come out at a scale of about 10^4: in float32 the
rounding of a token is then a sizeable fraction of the last step's std (about 0.006) that the acceptance
ratio measures. In float64 it is not, and exactness does not care how good the model is.
"""
import copy
import math

import numpy as np
import pytest
import torch

from fastar.model_loaders.shared.protocol import ClassConditioning
from fastar.samplers.masked_loops import continuous_acceptance as rule
from fastar.samplers.masked_loops import cspd as cspd_module
from fastar.samplers.masked_loops.cspd import CSpDSettings, cspd_decode, merged_schedule
from fastar.samplers.masked_loops.masked import MaskedSettings, masked_decode
from fastar.tests.test_cspd import ks_normal
from fastar.tests.test_mar import tiny_mar

N = 2000  # images per arm
SETTINGS = MaskedSettings(num_iter=6, cfg_scale=2.5, cfg_schedule="linear", temperature=0.8, diffusion_steps=6)
CSPD = CSpDSettings(gamma=2, prefill=0.2)
ALPHA = 1e-3  # for the smallest Bonferroni-corrected p-value over the statistics


@pytest.fixture(scope="module")
def models():
    target = tiny_mar(0).double()
    draft = copy.deepcopy(target)
    with torch.no_grad():  # other class vectors: log p/q of the drafts spread over about -1 .. 0.5, 79% accepted
        draft.class_emb.weight.add_(0.003 * torch.randn(draft.class_emb.weight.shape, dtype=torch.float64,
                                                        generator=torch.Generator().manual_seed(1)))
    return target, draft


def rows() -> ClassConditioning:
    return ClassConditioning(torch.arange(N) % 4)


def plain(target, settings: MaskedSettings = SETTINGS, seed: int = 1, schedule=None) -> torch.Tensor:
    return masked_decode(target, rows(), settings, generator=torch.Generator().manual_seed(seed),
                         gaussian_last_step=True, schedule=schedule)[0]


def speculative(target, draft, cspd: CSpDSettings = CSPD, seed: int = 2) -> torch.Tensor:
    tokens, stats = cspd_decode(target, draft, rows(), SETTINGS, cspd, generator=torch.Generator().manual_seed(seed))
    assert 0.2 < stats.acceptance_rate < 0.99, stats.acceptance_rate  # drafts both kept and replaced
    return tokens


DIRECTION = torch.randn(4, generator=torch.Generator().manual_seed(5), dtype=torch.float64)


def statistics(tokens: torch.Tensor) -> dict[str, np.ndarray]:
    """Per-image scalars of tokens ``[N, L, C]``."""
    proj = tokens @ (DIRECTION / DIRECTION.norm())
    stats = {"mean projection": proj.mean(1), "token 0": proj[:, 0], "token 4": proj[:, 4],
             "token norm": tokens.norm(dim=-1).mean(1),
             "raster neighbours": (proj[:, :-1] * proj[:, 1:]).mean(1), "rows above": (proj[:, :-3] * proj[:, 3:]).mean(1)}
    return {k: v.numpy() for k, v in stats.items()}


def ks_two_sample(a: np.ndarray, b: np.ndarray) -> float:
    """Asymptotic p-value of the two-sample Kolmogorov-Smirnov statistic."""
    both = np.sort(np.concatenate([a, b]))
    d = np.max(np.abs(np.searchsorted(np.sort(a), both, side="right") / len(a)
                      - np.searchsorted(np.sort(b), both, side="right") / len(b)))
    n = len(a) * len(b) / (len(a) + len(b))
    t = (math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n)) * d
    p = 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * t * t) for k in range(1, 101))
    return float(min(max(p, 0.0), 1.0))


def min_p(x: torch.Tensor, y: torch.Tensor) -> tuple[float, str]:
    """The smallest Bonferroni-corrected p-value over the statistics, and which statistic gave it."""
    sx, sy = statistics(x), statistics(y)
    ps = {k: min(1.0, ks_two_sample(sx[k], sy[k]) * len(sx)) for k in sx}
    worst = min(ps, key=ps.get)
    return ps[worst], worst


@pytest.fixture(scope="module")
def reference(models):
    return plain(models[0])


def test_steps_verification_is_plain_mar(models, reference):
    p, which = min_p(speculative(*models), reference)
    assert p > ALPHA, (p, which)


def test_merged_verification_is_mar_on_the_merged_schedule(models):
    target, draft = models
    merged = CSpDSettings(gamma=CSPD.gamma, prefill=CSPD.prefill, verify="merged")
    schedule = merged_schedule(target.cfg.num_tokens, SETTINGS, merged)
    assert len(schedule) - 1 < SETTINGS.num_iter
    on_schedule = plain(target, schedule=schedule, seed=3)
    p, which = min_p(speculative(target, draft, merged), on_schedule)
    assert p > ALPHA, (p, which)


def broken_accept(log_ratio):
    def accept(x, target, draft, generator, relaxation=None):
        u = torch.rand(x.shape[0], generator=generator, device=x.device)
        return torch.log(u) < log_ratio(x, target, draft)
    return accept


def zero_filled(target, draft, generator, max_tries):
    return rule.Resampled(torch.zeros_like(target.mean), torch.ones(target.mean.shape[0], dtype=torch.long), 0)


BREAKS = {
    "paper sigma_q/sigma_p factor": ("accept", broken_accept(lambda x, p, q: rule.log_acceptance_ratio(x, p, q) + 2)),
    "reference sigma_p/sigma_q factor": ("accept", broken_accept(lambda x, p, q: rule.log_acceptance_ratio(x, p, q) - 2)),
    "temperature 42 in the last-step exponent": (
        "accept", broken_accept(lambda x, p, q: (rule.log_density(x, p) - rule.log_density(x, q)) / 42)),
    "zero-filled rejections": ("sample_residual", zero_filled),
}


def standardised_residuals(models, cspd: CSpDSettings, monkeypatch) -> np.ndarray:
    """(token - mean) / std of every drafted token CSpD kept, against the target's last-step Gaussian it was
    verified with. Given its context and trajectory, an exactly verified token is N(mean, std^2) whatever
    the draft did, and the choice of kept steps depends only on earlier steps: i.i.d. N(0, 1) iff exact.
    Unlike the token statistics above (dominated by how a random head amplifies x_T), this sees every
    acceptance decision of a whole run at the scale of the last step."""
    residuals = []
    verify = cspd_module.CSpDRun.verify

    def recording(run, drafted, scored):
        kept = verify(run, drafted, scored)
        for d, p in zip(drafted[:kept], scored):
            rows = torch.arange(d.positions.shape[0]).unsqueeze(1).expand_as(d.positions)
            tokens = run.canvas.tokens[rows, d.positions].flatten(0, 1)
            residuals.append(((tokens - p.mean) / p.std).flatten())
        return kept

    monkeypatch.setattr(cspd_module.CSpDRun, "verify", recording)
    cspd_decode(*models, ClassConditioning(torch.arange(1200) % 4), SETTINGS, cspd,
                generator=torch.Generator().manual_seed(4))
    return torch.cat(residuals).numpy()


@pytest.mark.parametrize("verify", ["steps", "merged"])
def test_every_kept_draft_is_distributed_as_the_target_given_its_context(models, monkeypatch, verify):
    r = standardised_residuals(models, CSpDSettings(gamma=CSPD.gamma, prefill=CSPD.prefill, verify=verify), monkeypatch)
    assert len(r) > 20000 and ks_normal(r) > ALPHA, (len(r), ks_normal(r))


@pytest.mark.parametrize("name", BREAKS)
def test_each_break_of_a_whole_run_is_detected(models, monkeypatch, name):
    attribute, broken = BREAKS[name]
    monkeypatch.setattr(cspd_module, attribute, broken)
    r = standardised_residuals(models, CSPD, monkeypatch)
    assert ks_normal(r) < 1e-6, ks_normal(r)
