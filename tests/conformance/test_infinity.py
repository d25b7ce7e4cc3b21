"""Infinity transformers against the official code: the fixtures were made by FoundationVision/Infinity's
``Infinity.autoregressive_infer_cfg`` on tiny models in the 2B's layout (a raw state dict, block chunks) and the
8B's (2 x 2 patches, shards with an index), decoding with the infinity_vae fixture's VAEs; see build/infinity.py.
FastAR runs as a user runs it, both prompts in one batch where the release ran one per call, and must give every
scale's official greedy bits exactly and the official decoder's images."""
from __future__ import annotations

import json

from fastar.model_loaders.infinity.schedules import SCALES_AT, TEMPLATES, scale_schedule, template_of
from fastar.tests.conformance.common import assert_image_close, expected, fastar, fixture, generated_codes

CASES = ("infinity_2b", "infinity_8b")
SIZES = {"0.06M": 256, "0.25M": 512, "0.60M": 768, "1M": 1024}


def files(case: str) -> list:
    folder, named = fixture(case), expected(case)["source"]["files"]
    return ["--model", folder / named["model"], "--vq", folder / named["vae"], "--t5", folder / named["t5"]]


def test_scale_schedules_and_template_choices_are_the_releases():
    record = expected("infinity_2b")["schedules"]
    assert list(TEMPLATES) == record["templates"]
    for template, by_size in record["scales"].items():
        for pn, scales in by_size.items():
            assert [list(s) for s in TEMPLATES[float(template)][: SCALES_AT[SIZES[pn]]]] == scales, (template, pn)
    for ratio, template in record["chosen"].items():
        assert template_of(ratio) == template, ratio
        assert [list(s) for s in scale_schedule(256, ratio)[0]] == record["scales"][str(template)]["0.06M"]


def test_infinity_greedy_gives_every_scale_of_the_official_bits_and_its_images(tmp_path):
    for case in CASES:
        for run in expected(case)["runs"]:
            tag = f"{case}_{run['aspect_ratio'].replace(':', 'x')}"
            out, tokens = tmp_path / f"{tag}.png", tmp_path / f"{tag}.json"
            r = fastar("generate", *files(case), *run["args"], "--quiet", "--tokens-out", tokens, "--out", out,
                       cwd=tmp_path)
            assert r.returncode == 0, f"{case} {run['name']}: {r.stderr}"
            assert json.loads(tokens.read_text())["scales"] == run["vae_grid"]
            assert generated_codes(tokens) == run["codes"], f"{case} {run['name']}: bits differ from the official ones"
            for i, official in enumerate(run["images"]):
                assert_image_close(out.with_name(f"{out.stem}_{i}.png"), fixture(case) / official)


def test_the_official_bits_decode_to_the_official_images(tmp_path):
    """``decode --tokens-in`` of the official labels (in the file --tokens-out writes) through the VAE alone."""
    case = "infinity_8b"
    run = expected(case)["runs"][0]
    tokens = tmp_path / "official.json"
    tokens.write_text(json.dumps({"scales": run["vae_grid"], "tokens": run["codes"], "grid": run["vae_grid"][-1],
                                  "bits": 14}))
    r = fastar("decode", "--vq", files(case)[3], "--tokens-in", tokens, "--out", tmp_path / "decoded.png",
               cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for i, official in enumerate(run["images"]):
        assert_image_close(tmp_path / f"decoded_{i}.png", fixture(case) / official)
