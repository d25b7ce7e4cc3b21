"""VAR family against its official code: the fixtures were made by FoundationVision/VAR (VAR and its multi-scale
VQVAE) and microsoft/distilled_decoding (VAR-DD); see build/var.py. FastAR runs as a user runs it and must give
every scale's official greedy codes exactly and the official decoder's images."""
from __future__ import annotations

import json

from fastar.tests.conformance.common import assert_image_close, expected, fastar, fixture, generated_codes

VAR = "var"


def var_files() -> list:
    folder = fixture(VAR)
    return ["--model", folder / "var_d2.pth", "--vq", folder / "vae_ch32v32z8.pth"]


def test_var_greedy_gives_every_scale_of_the_official_codes_and_its_images(tmp_path):
    for run in expected(VAR)["runs"]:
        tag = run["name"].replace(" ", "_")
        out, tokens = tmp_path / f"{tag}.png", tmp_path / f"{tag}.json"
        r = fastar("generate", *var_files(), *run["args"], "--quiet", "--tokens-out", tokens, "--out", out,
                   cwd=tmp_path)
        assert r.returncode == 0, f"{run['name']}: {r.stderr}"
        assert json.loads(tokens.read_text())["scales"] == run["scales"]
        assert generated_codes(tokens) == run["codes"], f"{run['name']}: codes differ from the official sampler's"
        for i, official in enumerate(run["images"]):
            assert_image_close(out.with_name(f"{out.stem}_{i}.png"), fixture(VAR) / official)


def test_the_official_codes_decode_to_the_official_images(tmp_path):
    """The VQVAE alone: ``decode --tokens-in`` of the official codes (in the file --tokens-out writes)."""
    run = expected(VAR)["runs"][0]
    tokens = tmp_path / "official.json"
    tokens.write_text(json.dumps({"scales": run["scales"], "tokens": run["codes"], "grid": run["scales"][-1]}))
    r = fastar("decode", "--vq", fixture(VAR) / "vae_ch32v32z8.pth", "--tokens-in", tokens, "--out",
               tmp_path / "decoded.png", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for i, official in enumerate(run["images"]):
        assert_image_close(tmp_path / f"decoded_{i}.png", fixture(VAR) / official)


def test_var_dd_one_and_two_steps_give_the_official_f_hat_token_maps_and_images(tmp_path):
    """VAR-DD from a given noise: one step, two steps with the split after t2 and before it (--dd-split/--dd-t2 in
    tokens), and two steps at the split_t its NAME.json gives."""
    import numpy as np

    case = "var_dd"
    folder = fixture(case)
    for run in expected(case)["runs"]:
        tag = run["name"].replace(" ", "_")
        out, latents, tokens = tmp_path / f"{tag}.png", tmp_path / f"{tag}.npy", tmp_path / f"{tag}.json"
        r = fastar("generate", "--model", folder / "var-d2.pth", "--vq", fixture(VAR) / "vae_ch32v32z8.pth",
                   "--decoder", "dd", "--noise-in", folder / "noise.npy", *run["args"], "--quiet", "--latents-out",
                   latents, "--tokens-out", tokens, "--out", out, cwd=tmp_path)
        assert r.returncode == 0, f"{run['name']}: {r.stderr}"
        np.testing.assert_allclose(np.load(latents), np.load(folder / run["f_hat"]), rtol=0, atol=1e-4,
                                   err_msg=f"{run['name']}: f_hat differs from the official sampler's")
        assert json.loads(tokens.read_text())["scales"] == run["scales"]
        assert generated_codes(tokens) == run["codes"], f"{run['name']}: token maps differ from the official ones"
        for i, official in enumerate(run["images"]):
            assert_image_close(out.with_name(f"{out.stem}_{i}.png"), folder / official)
