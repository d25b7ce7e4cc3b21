"""The usual loops ``profile --baselines`` times FastAR's ``ar`` against must do the same work on the same
weights: greedy decoding gives the very tokens of FastAR's ``ar`` (the plain per-token loop with a growing cache
and LlamaGen's own ``generate()`` on the bundled demo model, transformers' Janus ``generate`` holding a Janus
shape's weights).

LlamaGen's ``generate()`` runs from a checkout of its official code, which the tests never fetch: set
FASTAR_LLAMAGEN_CODE to one (``git clone https://github.com/FoundationVision/LlamaGen``) to run those tests; without
it they are skipped (the generation rule itself is proven by tests/conformance's llamagen_c2i fixture)."""
import os
from types import SimpleNamespace

import pytest
import torch

from fastar.cli import build_parser
from fastar.errors import FastARError
from fastar.model_loaders import load_ar_model
from fastar.model_loaders.shared.demo import DEMO_AR
from fastar.model_loaders.shared.protocol import ClassConditioning, PromptConditioning
from fastar.samplers.token_loops.jacobi import ar_decode
from fastar.samplers.processing import SamplingSettings
from fastar.commands.profile.loop_baselines import baseline_loops, plain_loop
from fastar.commands.profile.speed import build, run_profile

GREEDY = SamplingSettings(cfg_scale=3.0, temperature=0.0)


def fastar_ar(model, conditioning, sampling=GREEDY, seed=0):
    return ar_decode(model, conditioning, sampling, generator=torch.Generator().manual_seed(seed))[0]


def test_the_plain_loop_draws_fastar_ar_tokens_on_the_demo_model():
    model = load_ar_model(DEMO_AR)
    labels = ClassConditioning(torch.tensor([2, 5]))
    loops = baseline_loops(model)
    assert list(loops) == ["plain loop"]  # LlamaGen's generate() only where a checkout is given
    codes = loops["plain loop"](labels, GREEDY, torch.Generator().manual_seed(0))
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
    loop = baseline_loops(model)["transformers generate()"]
    codes = loop(prompts, GREEDY, torch.Generator().manual_seed(0))
    assert codes.shape == (1, 36) and torch.equal(codes, fastar_ar(model, prompts))
    with pytest.raises(FastARError, match="no top-k or top-p"):
        loop(prompts, SamplingSettings(cfg_scale=3.0, top_k=5), torch.Generator())


def profile_args(**changes):
    return SimpleNamespace(**(vars(build_parser().parse_args(["profile"])) | dict(
        shape="tiny", windows="1,4", batches=[1], repeats=2, no_decoders=True, baselines=True) | changes))


def test_the_profile_puts_the_baseline_beside_ar():
    report = run_profile(profile_args())
    entry = report["batches"]["1"]
    assert set(entry["decoders"]) == {"ar"}  # --no-decoders keeps the ar the baseline is measured against
    loop = entry["baselines"]["plain loop"]
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


LLAMAGEN_CODE = os.environ.get("FASTAR_LLAMAGEN_CODE")
needs_llamagen_code = pytest.mark.skipif(not LLAMAGEN_CODE, reason="set FASTAR_LLAMAGEN_CODE to a LlamaGen checkout")


@needs_llamagen_code
def test_llamagen_generate_draws_fastar_ar_tokens_on_the_demo_model():
    model = load_ar_model(DEMO_AR)
    labels = ClassConditioning(torch.tensor([2, 5, 7]))
    loops = baseline_loops(model, llamagen_code=LLAMAGEN_CODE)
    assert list(loops) == ["plain loop", "LlamaGen generate()"]
    codes = loops["LlamaGen generate()"](labels, GREEDY, torch.Generator().manual_seed(0))
    assert codes.shape == (3, 256) and torch.equal(codes, fastar_ar(model, labels))
    with pytest.raises(FastARError, match="with CFG"):
        loops["LlamaGen generate()"](labels, SamplingSettings(cfg_scale=1.0), torch.Generator())


@needs_llamagen_code
def test_llamagen_generate_samples_the_processed_distribution():
    """Sampled at a temperature, top-k and top-p, its codes of a class score as that class's under teacher forcing
    better than another class's."""
    model = load_ar_model(DEMO_AR)
    loop = baseline_loops(model, llamagen_code=LLAMAGEN_CODE)["LlamaGen generate()"]
    sampling = SamplingSettings(cfg_scale=3.0, temperature=0.9, top_k=50, top_p=0.9)
    codes = loop(ClassConditioning(torch.tensor([3, 3])), sampling, torch.Generator().manual_seed(1))
    with torch.no_grad():
        own = model.training_logits(ClassConditioning(torch.tensor([3, 3])), codes).log_softmax(-1)
        other = model.training_logits(ClassConditioning(torch.tensor([6, 6])), codes).log_softmax(-1)
    picked = lambda logp: logp.gather(-1, codes[..., None]).sum()  # noqa: E731
    assert picked(own) > picked(other) + 50


def test_a_folder_without_llamagen_code_or_a_model_it_cannot_run_is_refused(tmp_path):
    with pytest.raises(FastARError, match="no autoregressive/models/gpt.py, autoregressive/models/generate.py there"):
        baseline_loops(load_ar_model(DEMO_AR), llamagen_code=tmp_path)
    with pytest.raises(FastARError, match="on LlamaGen class-to-image models; this is a Janus-Pro-shaped model"):
        baseline_loops(build("janus-tiny", torch.device("cpu"), torch.float32), llamagen_code=tmp_path)
    with pytest.raises(FastARError, match="--llamagen-code goes with --baselines"):
        run_profile(profile_args(baselines=False, llamagen_code=str(tmp_path)))


def test_every_decoder_is_timed_beside_the_usual_loop_in_one_table():
    from fastar.commands.profile.speed import PROFILED, parse_decoders

    report = run_profile(profile_args(decoders=parse_decoders("all"), no_decoders=False, repeats=1, grid="4x4"))
    entry = report["batches"]["1"]
    assert report["random_weights"] and tuple(entry["decoders"]) == tuple(PROFILED)  # the drafter: a random 2-layer
    table = entry["side_by_side"]
    assert table[0].startswith("| loop | same images as plain sampling |") and table[0].endswith(
        "| x faster than plain loop |")
    rows = {line.split(" | ")[0].removeprefix("| "): line.split(" | ") for line in table[2:]}
    assert list(rows) == ["plain loop", *(f"FastAR {name}" for name in PROFILED)]
    ar_speedup = entry["baselines"]["plain loop"]["ar_speedup"]
    assert rows["plain loop"][-1] == "1.00 |" and rows["FastAR ar"][-1] == f"{ar_speedup:.2f} |"
    assert [name for name, cells in rows.items() if cells[1] != "yes"] == ["FastAR gsd", "FastAR zipar"]
    assert rows["FastAR spec-static"][3] == f"{entry['decoders']['spec-static']['target_forwards']:.0f}"


def test_an_unknown_decoder_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["profile", "--decoders", "sjd,trees"])
    assert "argument --decoders: trees unknown; choose from ar, sjd, sjd-pac" in capsys.readouterr().err
