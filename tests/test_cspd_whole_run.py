"""Whole CSpD runs against plain MAR on the bundled demo MAR (a trained model: its tokens have unit scale,
so the last reverse step's std of about 0.006 is far above float32 rounding), drafted by the bundled demo
draft MAR: two-sample KS tests on per-image statistics (projections of the tokens, the token at fixed
positions, products of raster neighbours, token norms).

- ``steps`` verification against plain MAR (its last reverse step kept Gaussian) at the same num_iter, cfg
  schedule and temperature;
- ``merged`` verification against plain MAR on the merged schedule (each draft round as one step), which
  the test also tells apart from plain MAR at num_iter;
- the breaks that must be caught: the paper's and the reference's intermediate sigma factor, the
  reference's temperature 42 in the last-step exponent, zero-filled rejections.
"""
import math

import numpy as np
import pytest
import torch

from fastar.model_loaders import load_ar_model
from fastar.model_loaders.demo import DEMO_MAR, DEMO_MAR_DRAFT
from fastar.model_loaders.protocol import ClassConditioning
from fastar.samplers import continuous_acceptance as rule
from fastar.samplers import cspd as cspd_module
from fastar.samplers.cspd import CSpDSettings, cspd_decode, merged_schedule
from fastar.samplers.masked import MaskedSettings, masked_decode

N = 480  # images per arm
CHUNK = 160
SETTINGS = MaskedSettings(num_iter=8, cfg_scale=2.0, cfg_schedule="linear", temperature=0.9, diffusion_steps=20)
CSPD = CSpDSettings(gamma=3, prefill=0.2)
ALPHA = 1e-3  # per family of statistics, after the Bonferroni correction inside ``min_p``


@pytest.fixture(scope="module")
def models():
    target, draft = load_ar_model(DEMO_MAR), load_ar_model(DEMO_MAR_DRAFT)
    return target, draft


def labels() -> torch.Tensor:
    return torch.arange(N) % 8


def run(fn, seed: int) -> torch.Tensor:
    out = [fn(ClassConditioning(chunk), torch.Generator().manual_seed(seed + i))
           for i, chunk in enumerate(labels().split(CHUNK))]
    return torch.cat(out)


def plain(target, settings: MaskedSettings, seed: int = 1) -> torch.Tensor:
    return run(lambda rows, g: masked_decode(target, rows, settings, generator=g, gaussian_last_step=True)[0], seed)


def speculative(target, draft, cspd: CSpDSettings, seed: int = 2) -> torch.Tensor:
    return run(lambda rows, g: cspd_decode(target, draft, rows, SETTINGS, cspd, generator=g)[0], seed)


DIRECTION = torch.randn(8, generator=torch.Generator().manual_seed(5))


def statistics(tokens: torch.Tensor) -> dict[str, np.ndarray]:
    """Per-image scalars of tokens ``[N, L, C]``."""
    proj = tokens.float() @ (DIRECTION / DIRECTION.norm())
    stats = {"mean projection": proj.mean(1), "token 0": proj[:, 0], "token 137": proj[:, 137],
             "token norm": tokens.float().norm(dim=-1).mean(1),
             "raster neighbours": (proj[:, :-1] * proj[:, 1:]).mean(1), "rows above": (proj[:, :-16] * proj[:, 16:]).mean(1)}
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
    return plain(models[0], SETTINGS)


def test_steps_verification_is_plain_mar(models, reference):
    p, which = min_p(speculative(*models, CSPD), reference)
    assert p > ALPHA, (p, which)


def test_merged_verification_is_mar_on_the_merged_schedule(models):
    target, draft = models
    merged = CSpDSettings(gamma=CSPD.gamma, prefill=CSPD.prefill, verify="merged")
    schedule = merged_schedule(target.cfg.num_tokens, SETTINGS, merged)
    assert len(schedule) - 1 < SETTINGS.num_iter
    on_schedule = run(lambda rows, g: masked_decode(target, rows, SETTINGS, generator=g, gaussian_last_step=True,
                                                    schedule=schedule)[0], 3)
    p, which = min_p(speculative(target, draft, merged), on_schedule)
    assert p > ALPHA, (p, which)
    p, which = min_p(on_schedule, plain(target, SETTINGS))
    assert p < 1e-6, (p, which)  # and the merged schedule is not plain MAR at num_iter: the test can tell


def broken_accept(log_ratio):
    def accept(x, target, draft, generator):
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


@pytest.mark.parametrize("name", BREAKS)
def test_each_break_of_a_whole_run_is_detected(models, reference, monkeypatch, name):
    attribute, broken = BREAKS[name]
    monkeypatch.setattr(cspd_module, attribute, broken)
    p, which = min_p(speculative(*models, CSPD), reference)
    assert p < 1e-6, (p, which)
