"""DD's flow-matching map and the ``fm`` decoder (decoders.md, "DD").

The map must push Gaussian noise onto the codes with exactly the next-token probabilities, so ``fm`` (plain
AR with every token drawn by the map from its own noise) samples the exact joint of the enumerable toy. The
test statistic is the total-variation distance between the sampled and the exact joint, against its 99.9%
quantile under the null (multinomial draws from the exact joint). The seed's eq. (3), whose exponent has
the wrong sign, and a solver with too few steps must both be caught.
"""
import numpy as np
import pytest
import torch

from fastar.errors import FastARError
from fastar.model_loaders.shared.protocol import ClassConditioning
from fastar.samplers.few_step_loops import flow_map as fm
from fastar.samplers.decoders import DecoderSpec, decode
from fastar.samplers.processing import SamplingSettings
from fastar.commands.bench.toy_model import ToyModel

ROWS = 20000
MODEL = ToyModel(vocab=3, grid=(2, 2), num_classes=2, scale=2.0, seed=0)
SETTINGS = {
    "cfg2-topk2": SamplingSettings(cfg_scale=2.0, top_k=2),
    "T1.3-topp0.8": SamplingSettings(cfg_scale=1.5, temperature=1.3, top_p=0.8),
    "T0.7": SamplingSettings(cfg_scale=1.0, temperature=0.7),
}


def tv_distance(counts: np.ndarray, exact: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - exact).sum())


def null_tv_bound(exact: np.ndarray, rows: int, quantile=0.999, draws=4000) -> float:
    """The ``quantile`` of the TV distance of ``rows`` exact samples from the exact joint."""
    rng = np.random.default_rng(0)
    counts = rng.multinomial(rows, exact / exact.sum(), size=draws)
    return float(np.quantile(0.5 * np.abs(counts / rows - exact).sum(1), quantile))


def fm_tv(settings: SamplingSettings, spec=DecoderSpec("fm"), label=1, seed=0) -> tuple[float, float]:
    conditioning = ClassConditioning(torch.full((ROWS,), label, dtype=torch.long))
    tokens, stats = decode(MODEL, conditioning, settings, spec, seed=seed, codebook=MODEL.code_embeddings())
    assert stats.decoder == "fm" and stats.target_forwards == MODEL.num_tokens - 1
    exact = MODEL.exact_joint(label, cfg_scale=settings.cfg_scale, temperature=settings.temperature,
                              top_k=settings.top_k, top_p=settings.top_p).numpy()
    counts = np.bincount(MODEL.index_of(tokens).numpy(), minlength=len(exact)).astype(float)
    assert counts[exact == 0].sum() == 0, "sampled a sequence of probability zero"
    return tv_distance(counts, exact), null_tv_bound(exact, ROWS)


@pytest.mark.parametrize("name", SETTINGS)
def test_fm_samples_the_exact_joint(name):
    tv, bound = fm_tv(SETTINGS[name])
    assert tv < bound, f"fm is off the exact joint: TV {tv:.4f} > null 99.9% bound {bound:.4f}"


def seed_equation_3(x, t, log_p, codebook):
    """The seed's eq. (3) as printed: ``+`` in the exponent (and neither the 2 nor the t)."""
    if t == 0.0:
        return log_p.softmax(-1) @ codebook
    return (log_p + torch.cdist(x, codebook).square() / (1 - t) ** 2).softmax(-1) @ codebook


def test_the_seeds_sign_typo_is_detected(monkeypatch):
    monkeypatch.setattr(fm, "expected_code", seed_equation_3)
    tv, bound = fm_tv(SETTINGS["cfg2-topk2"])
    assert tv > 3 * bound


def test_a_too_coarse_solver_is_detected():
    tv, bound = fm_tv(SETTINGS["T0.7"], spec=DecoderSpec("fm", flow_steps=2))
    assert tv > bound


@pytest.mark.parametrize("codes,channels,scale", [(3, 4, 2.0), (64, 8, 3.0)])
def test_one_token_frequencies_match_p(codes, channels, scale):
    """Many noises under one distribution: each code's frequency is its probability (a unit-norm 8-d
    codebook of 64 codes, as LlamaGen's VQ looks, is the harder case: codes are close together)."""
    g = torch.Generator().manual_seed(1)
    codebook = torch.randn(codes, channels, generator=g)
    if channels == 8:
        codebook = torch.nn.functional.normalize(codebook, dim=-1)
    p = (torch.randn(codes, generator=g) * scale).softmax(-1)
    n = 100000
    got = fm.flow_map(p.expand(n, codes), torch.randn(n, channels, generator=g), codebook)
    counts = torch.bincount(got, minlength=codes).double().numpy()
    exact = p.double().numpy()
    assert tv_distance(counts, exact) < null_tv_bound(exact, n)


def test_the_map_is_deterministic_and_moves_with_the_noise():
    g = torch.Generator().manual_seed(2)
    codebook = torch.randn(16, 8, generator=g)
    p = torch.randn(500, 16, generator=g).softmax(-1)
    noise = torch.randn(500, 8, generator=g)
    first = fm.flow_map(p, noise, codebook)
    assert torch.equal(first, fm.flow_map(p, noise.clone(), codebook))
    assert (first != fm.flow_map(p, -noise, codebook)).float().mean() > 0.5
    greedy = torch.nn.functional.one_hot(p.argmax(-1), 16).float()  # temperature 0: every noise gives the argmax
    assert torch.equal(fm.flow_map(greedy, noise, codebook), p.argmax(-1))


def test_fm_runs_are_reproducible_by_seed():
    conditioning = ClassConditioning(torch.tensor([0, 1, 1]))
    run = lambda seed: decode(MODEL, conditioning, SETTINGS["T0.7"], DecoderSpec("fm"), seed=seed,  # noqa: E731
                              codebook=MODEL.code_embeddings())[0]
    assert torch.equal(run(5), run(5))


def test_fm_needs_the_matching_codebook():
    conditioning = ClassConditioning(torch.tensor([0]))
    with pytest.raises(FastARError, match="needs the VQ decoder's codebook to map noise"):
        decode(MODEL, conditioning, SETTINGS["T0.7"], DecoderSpec("fm"), seed=0)
    with pytest.raises(FastARError, match="has 5 codes but the AR model predicts 3"):
        decode(MODEL, conditioning, SETTINGS["T0.7"], DecoderSpec("fm"), seed=0, codebook=torch.randn(5, 4))
    with pytest.raises(FastARError, match="flow-map steps 1 is out of range"):
        decode(MODEL, conditioning, SETTINGS["T0.7"], DecoderSpec("fm", flow_steps=1), seed=0,
               codebook=MODEL.code_embeddings())
