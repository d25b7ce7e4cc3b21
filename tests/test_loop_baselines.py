"""The usual loops ``profile --baselines`` times FastAR's ``ar`` against must do the same work on the same
weights: greedy decoding gives the very tokens of FastAR's ``ar`` (the plain per-token loop with a growing cache
on the bundled demo model, transformers' Janus ``generate`` holding a Janus shape's weights)."""
from types import SimpleNamespace

import pytest
import torch

from fastar.errors import FastARError
from fastar.model_loaders import load_ar_model
from fastar.model_loaders.shared.demo import DEMO_AR
from fastar.model_loaders.shared.protocol import ClassConditioning, PromptConditioning
from fastar.samplers.token_loops.jacobi import ar_decode
from fastar.samplers.processing import SamplingSettings
from fastar.commands.profile.loop_baselines import baseline_for, plain_loop
from fastar.commands.profile.speed import build, run_profile

GREEDY = SamplingSettings(cfg_scale=3.0, temperature=0.0)


def fastar_ar(model, conditioning, sampling=GREEDY, seed=0):
    return ar_decode(model, conditioning, sampling, generator=torch.Generator().manual_seed(seed))[0]


def test_the_plain_loop_draws_fastar_ar_tokens_on_the_demo_model():
    model = load_ar_model(DEMO_AR)
    labels = ClassConditioning(torch.tensor([2, 5]))
    name, loop = baseline_for(model)
    assert name == "plain-loop"
    codes = loop(labels, GREEDY, torch.Generator().manual_seed(0))
    assert codes.shape == (2, 256) and torch.equal(codes, fastar_ar(model, labels))


def test_the_plain_loop_samples_the_processed_distribution():
    """Sampled, the loop still follows the model: its codes of a class score as that class's under teacher forcing
    better than another class's (a loop that fed the wrong position or forgot its cache would not)."""
    model = load_ar_model(DEMO_AR)
    sampling = SamplingSettings(cfg_scale=3.0, top_k=50, top_p=0.9)
    codes = plain_loop(model, ClassConditioning(torch.tensor([3, 3])), sampling, torch.Generator().manual_seed(1))
    with torch.no_grad():
        own = model.training_logits(ClassConditioning(torch.tensor([3, 3])), codes).log_softmax(-1)
        other = model.training_logits(ClassConditioning(torch.tensor([6, 6])), codes).log_softmax(-1)
    picked = lambda logp: logp.gather(-1, codes[..., None]).sum()  # noqa: E731
    assert picked(own) > picked(other) + 50


def test_transformers_generate_holds_the_same_janus_weights():
    pytest.importorskip("transformers")
    model = build("janus-tiny", torch.device("cpu"), torch.float32)
    prompts = PromptConditioning(["a photo"])
    name, loop = baseline_for(model)
    assert name == "transformers-generate"
    codes = loop(prompts, GREEDY, torch.Generator().manual_seed(0))
    assert codes.shape == (1, 36) and torch.equal(codes, fastar_ar(model, prompts))
    with pytest.raises(FastARError, match="no top-k or top-p"):
        loop(prompts, SamplingSettings(cfg_scale=3.0, top_k=5), torch.Generator())


def profile_args(**changes):
    args = dict(shape="tiny", model=None, grid=None, drafter=None, tree="chain", device="cpu", dtype=None,
                windows="1,4", batches=[1], repeats=2, no_decoders=True, out=None, compile=False, baselines=True,
                gpu_weights=None, weights="auto", memory=False, kernels=False)
    return SimpleNamespace(**(args | changes))


def test_the_profile_puts_the_baseline_beside_ar():
    report = run_profile(profile_args())
    entry = report["batches"]["1"]
    assert set(entry["decoders"]) == {"ar"}  # --no-decoders keeps the ar the baseline is measured against
    loop = entry["baselines"]["plain-loop"]
    assert loop["target_forwards"] == 64 and loop["ar_speedup"] == loop["image_s"] / entry["decoders"]["ar"]["image_s"]


def test_a_janus_shape_on_a_smaller_grid_and_bad_options():
    from fastar.commands.profile.speed import SHAPES

    report = run_profile(profile_args(shape="janus-tiny", grid="3x3", batches=[1], windows="1", baselines=False,
                                      no_decoders=True, dtype="bf16"))
    assert report["grid"] == [3, 3] and report["dtype"] == "bf16"  # a 9-token image
    with torch.device("meta"):  # the real LLM's shape, counted without its 6 GB of weights
        real = SHAPES["janus-pro-1b"].build(grid=(3, 3))
    assert sum(p.numel() for p in real.parameters()) > 1.4e9
    with pytest.raises(FastARError, match="--grid 8: give rows x columns"):
        run_profile(profile_args(grid="8"))
    with pytest.raises(FastARError, match="--drafter goes with --model"):
        run_profile(profile_args(drafter="demo"))
