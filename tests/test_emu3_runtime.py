"""Emu3 beyond its conformance: the release's sampling defaults (CFG 3, top-k 2048) and image size (720 px area: a
90x90 grid) where the user gives none; the VQ decoder's mean and std from processor_config.json where transformers 5
wrote them there; 8-bit weights (at load, and ``python -m fastar quantize``'s copy of either layout, the VQ model of
transformers' layout kept); the memory estimate of its KV caches, negative prompt included. Streaming: the emu3 row of
tests/test_streaming.py."""
import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from fastar.cli import main
from fastar.commands.quantize import write_quantised
from fastar.memory import kv_cache_bytes, token_working_bytes
from fastar.model_loaders import load_ar_model, load_image_decoder
from fastar.model_loaders.emu3.loader import DEFAULT_AREA, emu3_grid
from fastar.model_loaders.shared.quantized import QuantizedLinear, weight_format
from fastar.pipeline import conditioning_for
from fastar.samplers.decoders import DecoderSpec, decode
from fastar.samplers.processing import SamplingSettings
from fastar.settings import NO_FLAGS, sampling_from
from fastar.tests.conformance.common import fixture
from test_prequantised import bitwise_equal
from test_stats_invariants import check_invariants

SMALL = {"image_size": 40, "aspect_ratio": "5:4"}  # a 4x6 grid


def test_the_releases_sampling_defaults_apply_unless_told():
    model = load_ar_model(fixture("emu3_hf"), **SMALL)
    own = sampling_from(NO_FLAGS, model)
    assert (own.cfg_scale, own.top_k, own.top_p, own.temperature) == (3.0, 2048, 1.0, 1.0)
    told = sampling_from(SimpleNamespace(cfg=1.0, top_k=0), model)  # flags win, one by one; 0 given means off
    assert (told.cfg_scale, told.top_k) == (1.0, 0)
    assert sampling_from(NO_FLAGS, load_ar_model(fixture("lumina_mgpt"), image_size=128)).top_k == 0  # Emu3's only


def test_the_release_size_is_720_px_of_area(tmp_path):
    assert emu3_grid(DEFAULT_AREA, None) == (90, 90)
    folder = shutil.copytree(fixture("emu3_hf"), tmp_path / "emu3")
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = 9216  # the release's: room for 90 rows of 91
    (folder / "config.json").write_text(json.dumps(config))
    model = load_ar_model(folder)
    assert model.grid == (90, 90)
    assert model.prompts.tokenizer.decode(model.cfg.size_ids) == "90*90"  # the header says it, height first


def test_mean_and_std_read_from_processor_config_where_transformers_5_writes_them(tmp_path):
    """transformers 5's processor.save_pretrained puts the image processor's settings inside processor_config.json
    ({"image_processor": {...}}); preprocessor_config.json, where a folder has it, comes first."""
    folder = shutil.copytree(fixture("emu3_hf"), tmp_path / "emu3")
    inside = json.loads((folder / "processor_config.json").read_text())["image_processor"]
    (folder / "preprocessor_config.json").unlink()
    decoder = load_image_decoder(folder)
    assert decoder.cfg.image_mean == tuple(inside["image_mean"]) != (0.5, 0.5, 0.5)
    assert decoder.cfg.image_std == tuple(inside["image_std"])
    (folder / "preprocessor_config.json").write_text(json.dumps({"image_mean": [0.1] * 3, "image_std": [0.2] * 3}))
    first = load_image_decoder(folder)
    assert (first.cfg.image_mean, first.cfg.image_std) == ((0.1,) * 3, (0.2,) * 3)


@pytest.mark.parametrize("case", ["emu3_hf", "emu3_baai"])
def test_8_bit_weights_load_and_decode(case):
    model = load_ar_model(fixture(case), "int8", device="cpu", **SMALL)
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert weight_format(model) == "int8" and len(layers) == 4 * len(model.model.layers)  # qkv, o, gate_up, down
    conditioning = conditioning_for(model, prompts=["a dog", "a cat"])
    codes, stats = decode(model, conditioning, SamplingSettings(cfg_scale=3.0, top_k=2048), DecoderSpec("sjd", window=8),
                          seed=1)
    check_invariants(stats, "sjd")
    assert 0 <= int(codes.min()) and int(codes.max()) < model.vocab_size


@pytest.mark.parametrize("case", ["emu3_hf", "emu3_baai"])
def test_the_quantize_command_writes_a_copy_of_either_layout_that_loads_again(case, tmp_path):
    out = write_quantised(fixture(case), "int8", tmp_path / "copy", image_size=40)
    loaded = load_ar_model(out, device="cpu", **SMALL)
    assert weight_format(loaded) == "int8"  # its own format, asked for nothing
    assert bitwise_equal(loaded.state_dict(), load_ar_model(fixture(case), "int8", device="cpu", **SMALL).state_dict())
    kept = {p.name for p in fixture(case).iterdir() if p.is_file()}
    assert {p.name for p in out.iterdir()} == kept  # config, tokenizer files (BAAI's tiktoken ones too), weights
    if case == "emu3_hf":  # the folder still holds its image decoder
        assert bitwise_equal(load_image_decoder(out).state_dict(), load_image_decoder(fixture(case)).state_dict())


def test_the_quantize_command_line(tmp_path, capsys):
    out = tmp_path / "emu3-int8"
    assert main(["quantize", "--model", str(fixture("emu3_hf")), "--weights", "int8", "--out", str(out),
                 "--image-size", "40"]) == 0
    assert main(["generate", "--model", str(out), "--vq", str(out), "--prompt", "a cat", "--image-size", "40",
                 "--aspect-ratio", "5:4", "--decoder", "sjd", "--device", "cpu", "--quiet",
                 "--out", str(tmp_path / "cat.png")]) == 0
    assert (tmp_path / "cat.png").is_file()


@pytest.mark.parametrize("negative", [None, ["blurry, low quality, jpeg artifacts, watermark, text, cropped"]])
def test_the_memory_estimate_holds_the_sessions_caches(negative):
    """The KV caches a session allocates (cond and uncond rows, the negative prompt's length included) are what the
    estimate counts, give or take its spare slots."""
    model = load_ar_model(fixture("emu3_hf"), device="cpu", **SMALL)
    conditioning = conditioning_for(model, prompts=["a dog", "a cat on a mat"], negative_prompts=negative)
    session = model.start(conditioning, cfg=True, max_window=8)
    estimate = kv_cache_bytes(model, conditioning, batch=2, use_cfg=True, window=8)
    assert session.cache_bytes <= estimate <= 1.5 * session.cache_bytes
    assert token_working_bytes(model, conditioning, 2, True, DecoderSpec("sjd", window=8)) > estimate
