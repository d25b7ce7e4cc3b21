"""FastVAR on Infinity against the official code: the fixture was made by csguoh/FastVAR's own Infinity
(``FastVARCrossAttnBlock`` blocks: self-attention, cross-attention and FFN pruned in layers 3..27, RoPE gathered for
the kept tokens, only their keys and values cached, the pruned tokens restored from the 24 x 24 scale; the scales of
width 48 and 64 never run) on a tiny random transformer of depth 32 over the 1M 1:1 schedule; see
build/fastvar_infinity.py. FastAR's ``--fastvar`` with its defaults, both prompts in one batch where the release ran
one per call, must give every scale's official greedy bits exactly, no bits for the skipped scales, and the official
decoder's images."""
from __future__ import annotations

import json

import numpy as np
from PIL import Image

from fastar.tests.conformance.common import assert_image_close, expected, fastar, fixture, generated_codes

CASE = "fastvar_infinity"
SHRINK = 4  # the images are kept at a quarter of their side: 4 x 4 means of the 1024 px pixels


def shrink(path, out) -> None:
    """``path``'s image as 4 x 4 means, rounded (what the fixture stores)."""
    a = np.asarray(Image.open(path).convert("RGB"), dtype=np.float64)
    h, w = a.shape[0] // SHRINK, a.shape[1] // SHRINK
    Image.fromarray(a.reshape(h, SHRINK, w, SHRINK, 3).mean((1, 3)).round().astype(np.uint8)).save(out)


def test_fastvar_on_infinity_gives_the_official_bits_of_every_scale_that_runs_and_its_images(tmp_path):
    folder, record = fixture(CASE), expected(CASE)
    named, run = record["source"]["files"], record["runs"][0]
    out, tokens = tmp_path / "fastvar.png", tmp_path / "fastvar.json"
    r = fastar("generate", "--model", folder / named["model"], "--vq", folder / named["vae"], "--t5",
               folder / named["t5"], *run["args"], "--quiet", "--tokens-out", tokens, "--out", out, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert len(run["vae_grid"]) == len(run["scales"]) - 2  # the release never runs 48 x 48 and 64 x 64
    assert json.loads(tokens.read_text())["scales"] == run["vae_grid"]
    assert generated_codes(tokens) == run["codes"], "FastVAR's bits differ from the official ones"
    for i, official in enumerate(run["images"]):
        shrink(out.with_name(f"{out.stem}_{i}.png"), tmp_path / f"small_{i}.png")
        assert_image_close(tmp_path / f"small_{i}.png", folder / official)


def test_the_official_bits_of_the_scales_that_ran_decode_to_the_official_images(tmp_path):
    """``decode --tokens-in`` of the official labels: the skipped scales absent, the file's grid the 64 x 64 one."""
    folder, record = fixture(CASE), expected(CASE)
    run = record["runs"][0]
    tokens = tmp_path / "official.json"
    tokens.write_text(json.dumps({"scales": run["vae_grid"], "tokens": run["codes"], "grid": run["scales"][-1],
                                  "bits": 32}))
    r = fastar("decode", "--vq", folder / record["source"]["files"]["vae"], "--tokens-in", tokens, "--out",
               tmp_path / "decoded.png", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for i, official in enumerate(run["images"]):
        shrink(tmp_path / f"decoded_{i}.png", tmp_path / f"small_{i}.png")
        assert_image_close(tmp_path / f"small_{i}.png", folder / official)
