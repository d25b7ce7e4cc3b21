"""Chameleon family against its official code (fixtures from build/chameleon.py): Anole as LANTERN's Anole class
generates it (prompt, ``<reserved08706>``, boi; the CFG row bos, boi), Lumina-mGPT as its own inference solver
generates it from a folder its own classes saved (QK norms stored per model-parallel shard, row ends, CFG from the
image start); both decoded by Meta's VQGAN through Anole's TokenManager / Lumina-mGPT's ImageTokenizer."""
import json

import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fastar.errors import FastARError
from fastar.model_loaders import load_ar_model

from fastar.tests.conformance.common import (assert_image_close, assert_spec_run, assert_tree_run, expected, fastar,
                                             fixture, generated_codes, session_drafts)

VQGAN = "chameleon_vqgan/vqgan.ckpt"


def run_case(case: str, decoder: str, tmp_path):
    run = expected(case)["runs"][0]
    r = fastar("generate", "--model", fixture(case), "--vq", fixture("chameleon_vqgan") / "vqgan.ckpt",
               *run["args"], "--decoder", decoder, "--dtype", "fp32", "--quiet", "--tokens-out", tmp_path / "t.json",
               "--out", tmp_path / "image.png", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    return run, generated_codes(tmp_path / "t.json")


def test_anole_gives_lanterns_greedy_codes_and_metas_image(tmp_path):
    run, codes = run_case("anole", "ar", tmp_path)
    for row, (ours, official) in enumerate(zip(codes, run["codes"])):
        first = next((i for i, (a, b) in enumerate(zip(ours, official)) if a != b), None)
        assert first is None, f"prompt {row}: code {first} differs from LANTERN's Anole generate"
    assert_image_close(tmp_path / "image_0.png", fixture("anole") / run["images"][0])


@pytest.mark.parametrize("decoder", ["ar", "sjd"])
def test_lumina_mgpt_gives_its_solvers_greedy_codes_and_image(decoder, tmp_path):
    run, codes = run_case("lumina_mgpt", decoder, tmp_path)
    assert codes == run["codes"]
    assert_image_close(tmp_path / "image_0.png", fixture("lumina_mgpt") / run["images"][0])


@pytest.mark.parametrize("decoder", ["ar", "sjd"])
@pytest.mark.parametrize("shape", [0, 1], ids=["4:3 128x96", "2:5 64x160"])
def test_lumina_mgpt_non_square_gives_its_solvers_greedy_codes_and_image(shape, decoder, tmp_path):
    """--aspect-ratio at --image-size 128: the release's shape of that ratio (its generate_crop_size_list), the size
    tokens height first, the grid read from them (expected_shapes.json, the official solver on the same folder)."""
    run = json.loads((fixture("lumina_mgpt") / "expected_shapes.json").read_text())["runs"][shape]
    r = fastar("generate", "--model", fixture("lumina_mgpt"), "--vq", fixture("chameleon_vqgan") / "vqgan.ckpt",
               *run["args"], "--decoder", decoder, "--dtype", "fp32", "--quiet", "--tokens-out", tmp_path / "t.json",
               "--out", tmp_path / "image.png", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert generated_codes(tmp_path / "t.json") == run["codes"]
    assert Image.open(tmp_path / "image_0.png").size == (run["width"], run["height"])
    assert_image_close(tmp_path / "image_0.png", fixture("lumina_mgpt") / run["images"][0])


def test_the_lumina_fixture_keeps_the_released_qk_norm_layout():
    """[model_parallel_size, head_dim] = [1, 8]: the layout that did not load before; the test above proves it."""
    with safe_open(str(fixture("lumina_mgpt") / "model.safetensors"), "pt") as f:
        assert list(f.get_slice("model.layers.0.self_attn.q_norm.weight").get_shape()) == [1, 8]


def test_a_qk_norm_of_neither_layout_is_refused_with_its_shape(tmp_path):
    folder = tmp_path / "lumina_mgpt"
    folder.mkdir()
    for f in fixture("lumina_mgpt").iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.layers.0.self_attn.q_norm.weight"] = torch.ones(3, 8, dtype=torch.float16)  # 2 heads: no fit
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(FastARError, match=r"q_norm.weight has shape \[3, 8\].*\[2, 8\] \(one row per head\)"):
        load_ar_model(folder, image_size=128)


ANOLE_LANTERN = "anole_lantern"


def test_anole_drafter_drafts_what_lanterns_drafter_drafts():
    """LANTERN's Anole drafter folder (config.json + pytorch_model.bin) on the anole target, both prompts in one
    batch (left padding) with the CFG rows: over the target's hidden states and the official greedy codes, the
    drafter's rows replay each prompt (row t: the target's hidden at slot t with the token at slot t+1) at the
    target's positions (the CFG row shifted); every greedy draft is the official drafter's and the sampled rows'
    CFG-combined logits agree to 1e-4."""
    import numpy as np

    from fastar.model_loaders.drafters.loader import load_drafter
    from fastar.model_loaders.shared.protocol import PromptConditioning

    folder, run = fixture(ANOLE_LANTERN), expected(ANOLE_LANTERN)["runs"][0]
    args = run["args"]
    prompts = [args[i + 1] for i, a in enumerate(args) if a == "--prompt"]
    cfg = float(args[args.index("--cfg") + 1])
    model = load_ar_model(fixture("anole"), dtype=torch.float32)
    drafter = load_drafter(folder / "drafter", model)
    logits = session_drafts(model, drafter, PromptConditioning(prompts), torch.tensor(run["codes"]), cfg)
    assert logits.argmax(-1).tolist() == run["drafts"], "greedy drafts differ from LANTERN's drafter"
    np.testing.assert_allclose(logits[:, run["drafter_logit_rows"]].numpy(), np.load(folder / "drafter_logits.npy"),
                               rtol=0, atol=1e-4)


def test_anole_drafter_greedy_spec_gives_lanterns_codes_and_acceptance(tmp_path):
    """``--decoder spec`` with the drafter, greedy: the codes and the acceptance of LANTERN's EaModel.generate
    (a chain of 4 drafts per target forward), whose codes are the target's greedy codes."""
    assert_spec_run(ANOLE_LANTERN, ["--model", fixture("anole"), "--vq", fixture("chameleon_vqgan") / "vqgan.ckpt",
                                    "--dtype", "fp32"], tmp_path, target_codes=expected("anole")["runs"][0]["codes"])


@pytest.mark.slow  # about 25 s each on 2 cores: 2x1024 codes, 58-draft trees over 8861 ids
@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_anole_drafter_greedy_trees_give_lanterns_codes_and_acceptance(kind, tmp_path):
    """LANTERN's Anole EaModel.generate with static_tree True (naive_extend_57) and False (its dynamic tree at its
    defaults), greedy, one prompt per call: FastAR's ``--tree static`` / ``--tree dynamic`` with both prompts in one
    batch give its codes (the target's greedy codes) and its accept lengths."""
    model_args = ["--model", fixture("anole"), "--vq", fixture("chameleon_vqgan") / "vqgan.ckpt", "--dtype", "fp32"]
    assert_tree_run(ANOLE_LANTERN, kind, model_args, tmp_path)
