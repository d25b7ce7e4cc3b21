"""Emu3's folders refused with a message that says what is wrong (tests/conformance/test_emu3.py proves what loads):
weights missing, a LLaMA folder that is not Emu3, tokenizer files missing or from another model, shapes FastAR does
not draw; and the grid of an image area at a ratio, as both releases' processors compute it."""
import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from fastar.errors import FastARError
from fastar.model_loaders import load_ar_model
from fastar.model_loaders.emu3.loader import emu3_grid
from fastar.pipeline import conditioning_for
from fastar.tests.conformance.common import fixture


def copy(case: str, tmp_path):
    folder = tmp_path / case
    shutil.copytree(fixture(case), folder)
    return folder


@pytest.mark.parametrize(("area", "ratio", "grid"), [(720 * 720, "1:1", (90, 90)), (720 * 720, "16:9", (68, 120)),
                                                     (36 * 36, "1:1", (4, 4)), (36 * 36, "5:4", (4, 5)),
                                                     (36 * 36, "16:9", (3, 6)), (512 * 512, "4:3", (55, 74))])
def test_the_grid_of_an_area_at_a_ratio(area, ratio, grid):
    assert emu3_grid(area, ratio) == grid  # rows first; Python's round: 4.5 -> 4


@pytest.mark.parametrize("ratio", ["16x9", "0:1", "a:b", "1:-2"])
def test_a_ratio_that_is_no_width_and_height_is_refused(ratio):
    with pytest.raises(FastARError, match="WIDTH:HEIGHT"):
        emu3_grid(720 * 720, ratio)


def test_a_size_past_the_models_positions_is_refused():
    with pytest.raises(FastARError, match="more than the model's 512 positions"):  # the fixture's; the release's 9216
        load_ar_model(fixture("emu3_hf"), image_size=200)


@pytest.mark.parametrize("case", ["emu3_hf", "emu3_baai"])
def test_missing_weights_are_named(case, tmp_path):
    folder = copy(case, tmp_path)
    weights = load_file(str(folder / "model.safetensors"))
    dropped = next(k for k in weights if k.endswith("layers.1.mlp.down_proj.weight"))
    del weights[dropped]
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(FastARError, match=r"missing .*layers\.1\.mlp\.down_proj\.weight"):
        load_ar_model(folder, image_size=36)


def test_a_llama_folder_that_is_not_emu3_is_refused(tmp_path):
    folder = copy("emu3_baai", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(FastARError, match="does not say Emu3"):
        load_ar_model(folder)


def test_a_single_weights_file_is_refused(tmp_path):
    folder = copy("emu3_hf", tmp_path)
    with pytest.raises(FastARError, match="read from its folder"):
        load_ar_model(folder / "model.safetensors")


@pytest.mark.parametrize(("case", "file", "message"), [("emu3_hf", "tokenizer.json", "no tokenizer.json"),
                                                      ("emu3_baai", "emu3_vision_tokens.txt", "emu3_vision_tokens.txt")])
def test_missing_tokenizer_files_are_named(case, file, message, tmp_path):
    folder = copy(case, tmp_path)
    (folder / file).unlink()
    with pytest.raises(FastARError, match=message):
        load_ar_model(folder, image_size=36)


def test_tokenizer_files_of_another_model_are_refused(tmp_path):
    folder = copy("emu3_baai", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["boi_token_id"] += 1
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(FastARError, match="disagree: boi_token_id"):
        load_ar_model(folder)


def test_shape_and_negative_prompts_are_refused_where_the_release_has_none():
    with pytest.raises(FastARError, match="draws square images"):
        load_ar_model(fixture("anole"), aspect_ratio="16:9")
    with pytest.raises(FastARError, match="Lumina-mGPT at 128 px draws the shapes of its release's size list"):
        load_ar_model(fixture("lumina_mgpt"), image_size=128, aspect_ratio="16:9")
    lumina = load_ar_model(fixture("lumina_mgpt"), image_size=128)
    with pytest.raises(FastARError, match="leave --negative-prompt out"):
        conditioning_for(lumina, prompts=["a dog"], negative_prompts=["a cat"])


def test_negative_prompts_one_for_all_or_one_per_row():
    model = load_ar_model(fixture("emu3_hf"), image_size=36, aspect_ratio="5:4")
    one = conditioning_for(model, prompts=["a dog", "a cat"], negative_prompts=["blurry"])
    rows = model.prefixes(model.prompts.encode(one), cfg=True, **model.uncond_of(one))
    assert rows[2] == rows[3] and rows[2][0] == model.cfg.bos and rows[2][-1] == model.cfg.image_token
    with pytest.raises(FastARError, match="2 negative prompts for 3 prompts"):
        model.uncond_of(conditioning_for(model, prompts=["a", "b", "c"], negative_prompts=["x", "y"]))
