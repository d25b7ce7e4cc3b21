"""Emu3 in the real ComfyUI (the conformance fixtures' tiny models under the release's folder names): Load AR Model
lists both layouts' model folders, Load Image Decoder the transformers folder (its VQ inside) and BAAI's
VisionTokenizer folder; a negative prompt and a 5:4 aspect ratio draw what ``python -m fastar generate`` draws with
``--negative-prompt`` and ``--aspect-ratio`` (greedy: transformers' own codes), batches keep the negative prompt,
Lumina-mGPT draws its release's shape of a ratio as the command line does, and the families without either (Anole's
squares, a ratio Lumina-mGPT's release does not offer) say so."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from comfyui_helpers import ROOT, node_of, workflow_prompt
from PIL import Image
from standins import ANOLE_7B, EMU3_FIXTURES, EMU3_GEN, EMU3_GEN_HF, EMU3_VISION_TOKENIZER, LUMINA_768
from test_comfyui_mar import options, succeeded
from test_comfyui_runs import images_of

import harness

PROMPT, NEGATIVE = "a red ring on a blue background", "a blurry green square"  # the fixture's first row and its run


def emu3_prompt(object_info, sampler: str, model: str = EMU3_GEN_HF, vq: str = EMU3_GEN_HF, negative: str = NEGATIVE,
                aspect_ratio: str = "5:4", **widgets) -> dict:
    """The Emu3 template with the tiny model, a prompt, a negative prompt and a ratio; ``widgets`` the sampler's."""
    prompt = workflow_prompt("fastar_emu3_720", object_info)
    node_of(prompt, "FastARLoadModel")["inputs"].update(model_name=model, aspect_ratio=aspect_ratio)
    node_of(prompt, "FastARLoadVQ")["inputs"]["vq_name"] = vq
    node_of(prompt, "FastARTextConditioning")["inputs"].update(prompt=PROMPT, negative_prompt=negative)
    node_of(prompt, "FastARSamplerSJD")["inputs"].update(widgets)
    node_of(prompt, "FastARSamplerSJD")["class_type"] = sampler
    return prompt


def cli_images(models: Path, tmp_path: Path, model: str, vq: str, *args: str) -> np.ndarray:
    """What ``python -m fastar generate`` draws from the same folders; its codes are checked against the official
    ones where greedy (tests/conformance/test_emu3.py), the images here."""
    out = tmp_path / "cli.png"
    command = [sys.executable, "-m", "fastar", "generate", "--model", str(models / model), "--vq", str(models / vq),
               "--prompt", PROMPT, "--device", "cpu", "--out", str(out), "--tokens-out", str(tmp_path / "codes.json"),
               "--quiet", *args]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    written = sorted(tmp_path.glob("cli*.png"))
    return np.stack([np.asarray(Image.open(p).convert("RGB")) for p in written])


def assert_same_images(drawn: list[np.ndarray], expected: np.ndarray) -> None:
    """Equal within 1/255 (ComfyUI's Save Image truncates, the CLI rounds): one code off changes an 8 x 8 block."""
    assert len(drawn) == len(expected)
    for image, cli in zip(drawn, expected):
        assert image.shape == cli.shape
        assert np.abs(image.astype(int) - cli.astype(int)).max() <= 1


def test_loaders_list_both_layouts_and_their_image_decoders(object_info):
    models = options(object_info, "FastARLoadModel", "model_name")["options"]
    decoders = options(object_info, "FastARLoadVQ", "vq_name")["options"]
    assert {EMU3_GEN_HF, EMU3_GEN} <= set(models) and EMU3_VISION_TOKENIZER not in models
    assert {EMU3_GEN_HF, EMU3_VISION_TOKENIZER} <= set(decoders) and EMU3_GEN not in decoders
    assert not any(name.startswith(EMU3_VISION_TOKENIZER) and name != EMU3_VISION_TOKENIZER for name in decoders)


def test_the_new_inputs_are_optional_and_last(object_info):
    """Saved workflows store widgets by position: the new ones come last, optional, with defaults that change
    nothing."""
    loader, text = object_info["FastARLoadModel"]["input"], object_info["FastARTextConditioning"]["input"]
    assert object_info["FastARLoadModel"]["input_order"]["optional"][-1] == "aspect_ratio"
    assert object_info["FastARTextConditioning"]["input_order"]["optional"] == ["negative_prompt"]
    ratio = loader["optional"]["aspect_ratio"][1]
    assert ratio["default"] == "1:1" and {"1:1", "5:4", "16:9"} <= set(ratio["options"])
    negative = text["optional"]["negative_prompt"][1]
    assert negative["default"] == "" and negative["multiline"]


def test_greedy_emu3_with_a_negative_prompt_at_5_4_draws_the_clis_and_the_official_image(comfy, object_info, models,
                                                                                         tmp_path):
    entry = comfy.run(emu3_prompt(object_info, "FastARSamplerAR", cfg=3.0, top_k=1))
    succeeded(entry)
    drawn = images_of(comfy, entry)
    assert [image.shape for image in drawn] == [(32, 40, 3)]  # 4 x 5 codes at the area 36 x 36, 8 px each
    cli = cli_images(models, tmp_path, EMU3_GEN_HF, EMU3_GEN_HF, "--negative-prompt", NEGATIVE, "--aspect-ratio",
                     "5:4", "--cfg", "3.0", "--top-k", "1", "--decoder", "ar")
    assert_same_images(drawn, cli)
    codes = json.loads((tmp_path / "codes.json").read_text())["tokens"]
    expected = json.loads((EMU3_FIXTURES / "emu3_hf" / "expected.json").read_text())
    run = next(r for r in expected["runs"] if r["name"] == "greedy-cfg3-negative")
    assert codes == run["codes"][:1]  # transformers' generate, the same prompt, negative prompt and ratio
    official = np.asarray(Image.open(EMU3_FIXTURES / "emu3_hf" / "greedy-cfg3-negative_0.png").convert("RGB"))
    assert np.abs(drawn[0].astype(int) - official.astype(int)).max() <= 2
    stats = next(out["text"][0] for out in entry["outputs"].values() if "text" in out)
    assert f"text: {PROMPT}" in stats and "1 image of 20 tokens in" in stats


def test_sampled_sjd_batch_keeps_the_negative_prompt_and_draws_the_clis_images(comfy, object_info, models, tmp_path):
    """Two images of one prompt: the sampler repeats the conditioning, negative prompt included (without it the
    model's default negative prompt would guide, and the images would differ from the command line's)."""
    entry = comfy.run(emu3_prompt(object_info, "FastARSamplerSJD", cfg=3.0, top_k=0, seed=5, batch=2))
    succeeded(entry)
    cli = cli_images(models, tmp_path, EMU3_GEN_HF, EMU3_GEN_HF, "--negative-prompt", NEGATIVE, "--aspect-ratio",
                     "5:4", "--cfg", "3.0", "--seed", "5", "--batch", "2", "--decoder", "sjd", "--window", "16",
                     "--init", "random", "--coupling", "independent")
    assert_same_images(images_of(comfy, entry), cli)
    default = comfy.run(emu3_prompt(object_info, "FastARSamplerSJD", negative="", cfg=3.0, top_k=0, seed=5, batch=2))
    succeeded(default)
    assert not all(np.array_equal(a, b) for a, b in zip(images_of(comfy, default), images_of(comfy, entry)))


def test_baai_layout_with_its_vision_tokenizer_draws_the_clis_image_at_16_9(comfy, object_info, models, tmp_path):
    entry = comfy.run(emu3_prompt(object_info, "FastARSamplerAR", EMU3_GEN, EMU3_VISION_TOKENIZER, negative="",
                                  aspect_ratio="16:9", cfg=3.0, top_k=1))
    succeeded(entry)
    drawn = images_of(comfy, entry)
    assert [image.shape for image in drawn] == [(24, 48, 3)]  # 3 x 6 codes at the area 36 x 36
    cli = cli_images(models, tmp_path, EMU3_GEN, EMU3_VISION_TOKENIZER, "--aspect-ratio", "16:9", "--cfg", "3.0",
                     "--top-k", "1", "--decoder", "ar")
    assert_same_images(drawn, cli)


def test_lumina_mgpt_draws_the_clis_image_at_4_3(comfy, object_info, models, tmp_path):
    """The stand-in draws 128 px (its config.json): 4:3 is its release's 128 x 96 shape, 6 x 8 codes (24 x 32 px
    through the stand-in VQGAN's 4 px codes)."""
    entry = comfy.run(emu3_prompt(object_info, "FastARSamplerAR", LUMINA_768, "vqgan.ckpt", negative="",
                                  aspect_ratio="4:3", cfg=3.0, top_k=1))
    succeeded(entry)
    drawn = images_of(comfy, entry)
    assert [image.shape for image in drawn] == [(24, 32, 3)]
    cli = cli_images(models, tmp_path, LUMINA_768, "vqgan.ckpt", "--aspect-ratio", "4:3", "--cfg", "3.0",
                     "--top-k", "1", "--decoder", "ar")
    assert_same_images(drawn, cli)


@pytest.mark.parametrize("change, message", [
    (lambda p: node_of(p, "FastARTextConditioning")["inputs"].update(negative_prompt="blurry"),
     "whose release guides CFG without a negative prompt: leave negative_prompt empty"),
    (lambda p: node_of(p, "FastARLoadModel")["inputs"].update(model_name=ANOLE_7B, aspect_ratio="16:9"),
     "which draws square images"),
    (lambda p: node_of(p, "FastARLoadModel")["inputs"].update(aspect_ratio="16:9"),
     "aspect ratio 16:9: Lumina-mGPT at 128 px draws the shapes of its release's size list, whose ratios "
     "(width:height) are 4:1, 7:2, 3:1, 5:2, 5:3, 4:3, 1:1, 3:4"),
])
def test_families_without_negative_prompts_or_shapes_say_so(comfy, object_info, change, message):
    prompt = emu3_prompt(object_info, "FastARSamplerAR", LUMINA_768, "vqgan.ckpt", negative="", aspect_ratio="1:1")
    change(prompt)
    error = harness.execution_error(comfy.run(prompt))
    assert error is not None and message in error["exception_message"]
