"""A smaller Emu3 of the same tokenizer drafts for Emu3 (spec: chains, static and dynamic trees) across the row ends:
greedy, it writes greedy AR's codes exactly; sampled, batch 2 under CFG against a negative prompt, its statistics keep
their definitions. Drafters that cannot serve Emu3 (EAGLE heads, another tokenizer, another family) are refused with
what to use instead."""
import json
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from fastar.errors import FastARError
from fastar.model_loaders.drafters.loader import load_drafter
from fastar.model_loaders.shared.demo import DEMO_AR, DEMO_TEXT_DRAFTER
from fastar.model_loaders.shared.quantized import weight_format
from fastar.pipeline import conditioning_for, load_models
from fastar.samplers.decoders import DecoderSpec, decode
from fastar.samplers.processing import SamplingSettings
from fastar.tests.conformance.common import fixture
from test_stats_invariants import check_invariants

GREEDY = SamplingSettings(cfg_scale=3.0, temperature=0.0)
SAMPLED = SamplingSettings(cfg_scale=3.0, temperature=0.9, top_k=40, top_p=0.95)
GRID = (4, 6)
SPECS = {"chain": DecoderSpec("spec", gamma=3), "static": DecoderSpec("spec", tree="static"),
         "dynamic": DecoderSpec("spec", tree="dynamic", tree_depth=3, tree_topk=3, tree_nodes=8)}


def smaller_emu3(folder):
    """The fixture's model cut to its first layer (one layer instead of two: a smaller model of the same release,
    same tokenizer and vocabulary), in transformers' layout; its first layer's weights scaled so it drafts a
    distribution of its own."""
    shutil.copytree(fixture("emu3_hf"), folder)
    weights = {k: v for k, v in load_file(str(folder / "model.safetensors")).items() if ".layers.1." not in k}
    weights = {k: v * 0.9 if "layers.0.mlp" in k else v for k, v in weights.items()}
    save_file(weights, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["num_hidden_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def emu3(tmp_path_factory):
    target = str(fixture("emu3_hf"))
    drafter = smaller_emu3(tmp_path_factory.mktemp("drafter") / "emu3-small")
    models = load_models(target, target, "cpu", "fp32", drafter_path=str(drafter), image_size=40, aspect_ratio="5:4")
    assert models.drafter.grid == models.ar.grid == GRID  # the drafter takes its target's grid
    assert len(models.drafter.model.model.layers) == 1
    return models


def run(models, spec, sampling, seed=1, drafter=True):
    conditioning = conditioning_for(models.ar, prompts=["a red apple on a table", "a dog"],
                                    negative_prompts=["blurry, low quality"])
    codes, stats = decode(models.ar, conditioning, sampling, spec, seed=seed, codebook=models.codebook(),
                          drafter=models.drafter if drafter else None)
    assert codes.shape == (2, GRID[0] * GRID[1]) and 0 <= int(codes.min()) and int(codes.max()) < models.ar.vocab_size
    return codes, stats


@pytest.mark.parametrize("tree", SPECS)
def test_greedy_spec_writes_greedy_ars_codes(emu3, tree):
    ar, _ = run(emu3, DecoderSpec("ar"), GREEDY, drafter=False)
    codes, stats = run(emu3, SPECS[tree], GREEDY, seed=5)
    assert torch.equal(codes, ar)
    assert stats.accepted_tokens > 0 and stats.target_forwards < GRID[0] * GRID[1] - 1  # its drafts were kept


@pytest.mark.parametrize("tree", SPECS)
def test_sampled_spec_keeps_the_statistics(emu3, tree):
    _, stats = run(emu3, SPECS[tree], SAMPLED)
    check_invariants(stats, "spec")
    assert stats.drafter_forwards > 0


def test_the_drafter_loads_in_8_bits_and_drafts(emu3, tmp_path):
    drafter = load_drafter(smaller_emu3(tmp_path / "small"), emu3.ar, weights="int8")
    assert weight_format(drafter.model) == "int8"
    _, stats = run(replace(emu3, drafter=drafter), SPECS["chain"], SAMPLED)
    check_invariants(stats, "spec")


def test_an_eagle_drafter_is_refused_with_what_to_use(emu3):
    with pytest.raises(FastARError, match="no EAGLE drafter serves an Emu3 model: draft with a smaller Emu3"):
        load_drafter(DEMO_TEXT_DRAFTER, emu3.ar)


def test_a_drafter_of_another_tokenizer_or_family_is_refused(emu3):
    with pytest.raises(FastARError, match="other vocabulary entries|other tokens than the target"):
        load_drafter(fixture("emu3_baai"), emu3.ar)  # BAAI's layout, another (tiny) tokenizer
    with pytest.raises(FastARError, match="smaller model of the same family with the same tokenizer"):
        load_drafter(DEMO_AR, emu3.ar)  # a LlamaGen GPT
