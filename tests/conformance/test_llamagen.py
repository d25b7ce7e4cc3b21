"""LlamaGen family against its official code: the fixtures were made by FoundationVision/LlamaGen (c2i, t2i),
microsoft/distilled_decoding (LlamaGen-DD) and jadohu/LANTERN (the LlamaGen drafter); see build/llamagen.py.
FastAR runs as a user runs it and must give the official greedy codes exactly and the official decoder's images."""
from __future__ import annotations

from pathlib import Path

import pytest

from common import assert_image_close, expected, fastar, fixture, generated_codes

C2I = "llamagen_c2i"


def shared_vq() -> Path:
    return fixture(C2I) / "vq.pt"


def run_case(case: str, model_args: list, tmp_path: Path, only=None) -> None:
    """Each run of ``case``'s expected.json through ``python -m fastar generate``: codes exact, images close."""
    for run in expected(case)["runs"]:
        if only is not None and not only(run):
            continue
        tag = run["name"].replace(" ", "_")
        out, tokens = tmp_path / f"{tag}.png", tmp_path / f"{tag}.json"
        r = fastar("generate", *model_args, *run["args"], "--quiet", "--tokens-out", tokens, "--out", out,
                   cwd=tmp_path)
        assert r.returncode == 0, f"{run['name']}: {r.stderr}"
        assert generated_codes(tokens) == run["codes"], f"{run['name']}: codes differ from the official sampler's"
        for i, official in enumerate(run["images"]):
            produced = out.with_name(f"{out.stem}_{i}.png") if len(run["images"]) > 1 else out
            assert_image_close(produced, fixture(case) / official)


def test_c2i_greedy_ar_and_sjd_give_the_official_codes_and_images(tmp_path):
    folder = fixture(C2I)
    run_case(C2I, ["--model", folder / "gpt.pt", "--vq", shared_vq()], tmp_path)


def test_dd_student_one_and_two_steps_give_the_official_latents_and_images(tmp_path):
    """LlamaGen-DD: one step, and two steps with t2 before and after the split, from the same noise."""
    import numpy as np

    case = "llamagen_dd"
    folder = fixture(case)
    for run in expected(case)["runs"]:
        tag = run["name"].replace(" ", "_")
        out, latents = tmp_path / f"{tag}.png", tmp_path / f"{tag}.npy"
        r = fastar("generate", "--model", folder / "student.pt", "--vq", shared_vq(), "--decoder", "dd",
                   "--noise-in", folder / "noise.npy", *run["args"], "--quiet", "--latents-out", latents,
                   "--out", out, cwd=tmp_path)
        assert r.returncode == 0, f"{run['name']}: {r.stderr}"
        np.testing.assert_allclose(np.load(latents), np.load(folder / run["latents"]), rtol=0, atol=1e-4,
                                   err_msg=f"{run['name']}: latents differ from the official sampler's")
        for i, official in enumerate(run["images"]):
            assert_image_close(out.with_name(f"{out.stem}_{i}.png"), folder / official)
