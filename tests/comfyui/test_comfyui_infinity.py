"""Infinity in the real ComfyUI, on the conformance fixtures' tiny models (made by FoundationVision/Infinity's own
code) put into the server's models/fastar folder as users put the release's files there: Load AR Model lists the
2B's .pth and the 8B's folder of shards, Load Image Decoder their BSQ VAEs, Text Conditioning reads the prompt through
the fixture's tiny FLAN-T5 folder. Greedy runs of the Infinity-2B workflow at 1:1 and 3:4 (the loader's aspect_ratio)
draw what ``python -m fastar generate`` draws on the same files and the official decoder's images (the command line's
codes are the official bits); the 8B's folder runs likewise; a sampled batch repeats the prompt and draws the command
line's ``--batch 2``; a VAE of the other size is refused with the model's message."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from comfyui_helpers import ROOT, node_of, workflow_prompt
from PIL import Image
from test_comfyui_emu3 import assert_same_images
from test_comfyui_mar import options, succeeded
from test_comfyui_runs import failed, images_of

import harness

FIXTURES = ROOT / "tests" / "conformance" / "fixtures"
MODEL_2B, MODEL_8B = "infinity_2b_tiny.pth", "infinity_8b_tiny/"
VAE_2B, VAE_8B = "vae_d32.pth", "vae_d14_patchify.pth"
T5 = "flan-t5-xl/"  # the fixture's tiny FLAN-T5 under the folder name users download google/flan-t5-xl as
PROMPTS = ("a red cat sits on the green mat", "one blue dog under the sky")  # the fixtures' prompts, in order
OFFICIAL_TOLERANCE = 2  # of 255, as tests/conformance/common.py: the official decoder's image up to float order


def expected(case: str) -> dict:
    return json.loads((FIXTURES / case / "expected.json").read_text())


@pytest.fixture(scope="module")
def server(comfy_env, tmp_path_factory):
    """A ComfyUI of its own: the tiny T5 folder goes where users put flan-t5-xl, which the shared server's stand-in
    (another width) holds already."""
    base = tmp_path_factory.mktemp("comfyui_infinity")
    folder = base / "models" / "fastar"
    folder.mkdir(parents=True)
    shutil.copy(FIXTURES / "infinity_2b" / MODEL_2B, folder / MODEL_2B)
    shutil.copytree(FIXTURES / "infinity_8b" / MODEL_8B.rstrip("/"), folder / MODEL_8B.rstrip("/"))
    for vae in (VAE_2B, VAE_8B):
        shutil.copy(FIXTURES / "infinity_vae" / vae, folder / vae)
    shutil.copytree(FIXTURES / "infinity_2b" / "t5", folder / T5.rstrip("/"))
    comfy = harness.Server(base)
    comfy.start()
    comfy.folder = folder
    yield comfy
    comfy.stop()


@pytest.fixture(scope="module")
def info(server) -> dict:
    return server.object_info()


def infinity_prompt(info: dict, model: str = MODEL_2B, vae: str = VAE_2B, aspect_ratio: str = "1:1",
                    text: str = PROMPTS[0], **widgets) -> dict:
    """The Infinity-2B workflow on the tiny files at 256 px (the 0.06M schedule); ``widgets`` the sampler's."""
    prompt = workflow_prompt("fastar_infinity_2b", info)
    node_of(prompt, "FastARLoadModel")["inputs"].update(model_name=model, image_size="256", aspect_ratio=aspect_ratio)
    node_of(prompt, "FastARLoadVQ")["inputs"]["vq_name"] = vae
    node_of(prompt, "FastARTextConditioning")["inputs"].update(prompt=text, t5_folder=T5)
    node_of(prompt, "FastARSamplerAR")["inputs"].update(widgets)
    return prompt


def cli_images(folder: Path, tmp_path: Path, model: str, vae: str, *args) -> np.ndarray:
    """What ``python -m fastar generate`` draws from the same files; its codes go to tmp_path/codes.json."""
    out = tmp_path / "cli.png"
    command = [sys.executable, "-m", "fastar", "generate", "--model", str(folder / model.rstrip("/")), "--vq",
               str(folder / vae), "--t5", str(folder / T5.rstrip("/")), "--device", "cpu", "--image-size", "256",
               "--decoder", "ar", "--out", str(out), "--tokens-out", str(tmp_path / "codes.json"), "--quiet",
               *map(str, args)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    written = sorted(tmp_path.glob("cli*.png"))
    return np.stack([np.asarray(Image.open(p).convert("RGB")) for p in written])


def assert_official(image: np.ndarray, case: str, name: str) -> None:
    official = np.asarray(Image.open(FIXTURES / case / name).convert("RGB"))
    assert image.shape == official.shape
    assert np.abs(image.astype(int) - official.astype(int)).max() <= OFFICIAL_TOLERANCE


def stats_text(entry) -> str:
    return next(out["text"][0] for out in entry["outputs"].values() if "text" in out)


def test_loaders_list_the_2b_file_the_8b_folder_their_vaes_and_the_t5_folder(info):
    models = options(info, "FastARLoadModel", "model_name")["options"]
    decoders = options(info, "FastARLoadVQ", "vq_name")["options"]
    t5 = options(info, "FastARTextConditioning", "t5_folder")["options"]
    assert {MODEL_2B, MODEL_8B} <= set(models) and T5 not in models
    assert not any(name.startswith(MODEL_8B.rstrip("/")) and name != MODEL_8B for name in models)  # no shard alone
    assert {VAE_2B, VAE_8B} <= set(decoders) and MODEL_8B not in decoders
    assert t5[0] == T5
    sizes = options(info, "FastARLoadModel", "image_size")["options"]
    ratios = options(info, "FastARLoadModel", "aspect_ratio")["options"]
    assert {"256", "512", "768", "1024"} <= set(sizes) and {"1:1", "3:4", "16:9", "3:1"} <= set(ratios)


@pytest.mark.parametrize("ratio", ["1:1", "3:4"])
def test_greedy_2b_draws_the_clis_image_and_the_official_one(server, info, ratio, tmp_path):
    """The fixture's runs (cfg 3 / tau 0.5 at 1:1, cfg 4 / tau 1.0 at 3:4), greedy: the command line's codes are the
    official bits of the first prompt, and the node's image is the command line's and the official decoder's."""
    run = next(r for r in expected("infinity_2b")["runs"] if r["aspect_ratio"] == ratio)
    cfg, tau = run["args"][run["args"].index("--cfg") + 1], run["args"][run["args"].index("--temperature") + 1]
    entry = server.run(infinity_prompt(info, aspect_ratio=ratio, cfg=cfg, temperature=tau, top_k=1))
    succeeded(entry)
    drawn = images_of(server, entry)
    h, w = run["vae_grid"][-1]
    assert [image.shape for image in drawn] == [(16 * h, 16 * w, 3)]  # 16 x 16 at 1:1; 20 rows x 15 at 3:4
    cli = cli_images(server.folder, tmp_path, MODEL_2B, VAE_2B, "--prompt", PROMPTS[0], "--aspect-ratio", ratio,
                     "--cfg", cfg, "--temperature", tau, "--top-k", 1)
    assert_same_images(drawn, cli)
    assert json.loads((tmp_path / "codes.json").read_text())["tokens"] == run["codes"][:1]
    assert_official(drawn[0], "infinity_2b", run["images"][0])
    text = stats_text(entry)
    assert f"text: {PROMPTS[0]}" in text and f"in {len(run['scales'])} forwards" in text


def test_the_8b_shard_folder_loads_as_a_folder_and_draws_the_official_image(server, info, tmp_path):
    run = expected("infinity_8b")["runs"][0]
    entry = server.run(infinity_prompt(info, MODEL_8B, VAE_8B, text=PROMPTS[1], cfg=3.0, temperature=1.0, top_k=1))
    succeeded(entry)
    drawn = images_of(server, entry)
    assert [image.shape for image in drawn] == [(256, 256, 3)]  # 32 x 32 cells of 8 px, folded 2 x 2 into tokens
    cli = cli_images(server.folder, tmp_path, MODEL_8B, VAE_8B, "--prompt", PROMPTS[1], "--cfg", 3.0,
                     "--temperature", 1.0, "--top-k", 1)
    assert_same_images(drawn, cli)
    assert json.loads((tmp_path / "codes.json").read_text())["tokens"] == run["codes"][1:]
    assert_official(drawn[0], "infinity_8b", run["images"][1])


def test_a_sampled_batch_repeats_the_prompt_and_draws_the_clis_batch(server, info, tmp_path):
    """batch 2 at the release's top-k 900 and top-p 0.97: two images of the one prompt, different, the command line's
    ``--batch 2`` at the same seed; another seed another pair."""
    widgets = dict(seed=5, cfg=3.0, temperature=1.0, top_k=900, top_p=0.97, batch=2)
    entry = server.run(infinity_prompt(info, aspect_ratio="3:4", **widgets))
    succeeded(entry)
    drawn = images_of(server, entry)
    assert len(drawn) == 2 and not np.array_equal(drawn[0], drawn[1])
    cli = cli_images(server.folder, tmp_path, MODEL_2B, VAE_2B, "--prompt", PROMPTS[0], "--aspect-ratio", "3:4",
                     "--cfg", 3.0, "--temperature", 1.0, "--top-k", 900, "--top-p", 0.97, "--seed", 5, "--batch", 2)
    assert_same_images(drawn, cli)
    assert "2 images of" in stats_text(entry)
    other = images_of(server, server.run(infinity_prompt(info, aspect_ratio="3:4", **{**widgets, "seed": 6})))
    assert not np.array_equal(other[0], drawn[0])


def test_a_vae_of_the_other_size_is_refused_with_the_models_message(server, info):
    error = failed(server, infinity_prompt(info, MODEL_8B, VAE_2B, top_k=1))
    assert error["node_type"] == "FastARSamplerAR"
    assert "an Infinity model (bitwise next-scale text-to-image) works with" in error["exception_message"]
    assert "load the model's own" in error["exception_message"]
    prompt = infinity_prompt(info, top_k=1)
    decode = node_of(prompt, "FastARVQDecode")["inputs"]
    prompt["99"] = {"class_type": "FastARLoadVQ", "inputs": {"vq_name": VAE_8B, "dtype": "auto"}}
    decode["vq"] = ["99", 0]
    error = failed(server, prompt)
    assert error["node_type"] == "FastARVQDecode" and "pick the BSQ VAE the model was trained with" in \
        error["exception_message"]


def test_without_its_vae_the_sampler_says_to_connect_it(server, info):
    prompt = infinity_prompt(info, top_k=1)
    del node_of(prompt, "FastARSamplerAR")["inputs"]["preview_vq"]
    error = failed(server, prompt)
    assert "it samples through its BSQ VAE" in error["exception_message"]


@pytest.mark.parametrize("workflow, case, model", [("fastar_infinity_2b", "infinity_2b", MODEL_2B),
                                                   ("fastar_infinity_8b", "infinity_8b", MODEL_8B)])
def test_the_workflows_sample_at_their_releases_settings_at_1024_px(workflow, case, model):
    """The sampler's cfg, temperature, top-k and top-p are what the model of that layout says its release samples
    with (tau 0.5 for the 2B, 1.0 for the 8B), and the loader draws the release's 1024 px square."""
    from fastar.model_loaders import load_ar_model

    defaults = load_ar_model(FIXTURES / case / model.rstrip("/"), image_size=256).release_defaults
    nodes = json.loads((ROOT / "workflows" / f"{workflow}.json").read_text())["nodes"]
    sampler = next(n for n in nodes if n["type"] == "FastARSamplerAR")["widgets_values"]
    assert dict(zip(("cfg", "temperature", "top_k", "top_p"), sampler[2:6])) == defaults
    loader = next(n for n in nodes if n["type"] == "FastARLoadModel")["widgets_values"]
    assert loader[2] == "1024" and loader[5] == "1:1"
