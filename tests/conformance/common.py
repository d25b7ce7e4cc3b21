"""What every conformance test shares: the fixtures made by each family's official code (weights, the official
sampler's greedy codes, the official decoder's images) and FastAR run on them as a user runs it.

A fixture folder ``fixtures/<case>/`` holds the tiny checkpoint in the family's release format and
``expected.json``:
    {"source": {"repository": "owner/name" or "transformers", "commit": "...", "packages": {...},
                "builder": "tests/conformance/build/<family>.py", "made_with": "the classes and functions run"},
     "runs": [{"name": ..., "args": [CLI arguments after the model/decoder ones], "codes": [[...], ...],
               "images": ["<file>.png", ...]}]}
The builders in ``build/`` run the official code; they are run by hand when a fixture is (re)made, never by the
tests, which need only the committed files.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

FIXTURES = Path(__file__).resolve().parent / "fixtures"
IMAGE_TOLERANCE = 2  # of 255: the decoded image may differ from the official decoder's by float order only


def fixture(case: str) -> Path:
    folder = FIXTURES / case
    assert folder.is_dir(), f"conformance fixture {case} is missing: rebuild it with its builder in build/"
    return folder


def expected(case: str) -> dict:
    return json.loads((fixture(case) / "expected.json").read_text())


def fastar(*args, cwd) -> subprocess.CompletedProcess:
    """``python -m fastar ARGS`` in a subprocess, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "fastar", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=600)


def generated_codes(tokens_json: Path) -> list:
    """The codes ``generate --tokens-out`` wrote, one list per image."""
    return json.loads(Path(tokens_json).read_text())["tokens"]


def image_array(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"), dtype=np.int16)


def assert_image_close(produced: Path, official: Path, tolerance: int = IMAGE_TOLERANCE) -> None:
    """The image FastAR wrote is the official decoder's to within ``tolerance`` of 255 in every channel."""
    a, b = image_array(produced), image_array(official)
    assert a.shape == b.shape, f"{produced.name}: {a.shape} where the official image is {b.shape}"
    worst = int(np.abs(a - b).max())
    assert worst <= tolerance, f"{produced.name} differs from the official decoder's image by up to {worst}/255"


def assert_generate_runs(case: str, vq: Path, decoder: str, tmp_path: Path) -> None:
    """``generate`` with each of the case's runs (its arguments, ``--vq vq``, ``--decoder decoder``) gives the official
    codes exactly and the official images within the tolerance."""
    folder = fixture(case)
    for run in expected(case)["runs"]:
        tokens, out = tmp_path / f"{run['name']}.json", tmp_path / f"{run['name']}.png"
        r = fastar("generate", "--model", folder, "--vq", vq, "--decoder", decoder, *run["args"], "--quiet",
                   "--tokens-out", tokens, "--out", out, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert generated_codes(tokens) == run["codes"], f"{case} {run['name']} {decoder}: not the official codes"
        for i, image in enumerate(run["images"]):
            produced = out if len(run["images"]) == 1 else tmp_path / f"{run['name']}_{i}.png"
            assert_image_close(produced, folder / image)


def save_image(pixels, path: Path) -> None:
    """An official decoder's output (float ``[3, H, W]`` or ``[H, W, 3]`` in -1..1) as the PNG the tests compare
    with: mapped to 0..255 as FastAR maps its own decoder's output."""
    array = np.asarray(pixels, dtype=np.float32)
    if array.shape[0] == 3:
        array = array.transpose(1, 2, 0)
    array = np.clip((array + 1) * 127.5 + 0.5, 0, 255).astype(np.uint8)
    Image.fromarray(array).save(path)


def session_drafts(model, drafter, conditioning, codes, cfg: float):
    """FastAR's drafter driven as its spec decoding drives it, one code at a time over the given codes [B, N]: the
    target's session (with hidden states) feeds each code, the drafter's session catches up on that window. The
    CFG-combined draft logits [B, N - 1, V]: row k drafts code k + 1."""
    import torch

    with torch.no_grad():
        session = model.start(conditioning, cfg=True, max_window=1, hidden=True)
        drafting = drafter.start(conditioning, cfg=True, max_window=1, target_session=session)
        B, N = codes.shape
        last_out, last_start = session.first, torch.full((B,), -1)
        rows = []
        for n in range(1, N):
            at = torch.full((B,), n)
            out = drafting.catch_up(codes, at, last_out, last_start)
            rows.append(out.uncond[:, 0] + (out.cond[:, 0] - out.uncond[:, 0]) * cfg)
            last_out, last_start = session.forward(codes[:, n - 1:n], at - 1), at - 1
    return torch.stack(rows, 1).float()


def assert_spec_run(case: str, model_args: list, tmp_path: Path, target_codes=None) -> None:
    """``generate --decoder spec`` with the case's drafter, greedy: the official spec sampler's codes (which are
    the target's greedy codes, ``target_codes`` where given) and each code fixed at the iteration where the
    official sampler fixed it (its accept lengths)."""
    run = expected(case)["runs"][0]
    tokens, stats = tmp_path / "t.json", tmp_path / "s.json"
    r = fastar("generate", *model_args, "--drafter", fixture(case) / "drafter", *run["args"], "--quiet",
               "--tokens-out", tokens, "--stats-out", stats, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    codes = generated_codes(tokens)
    if target_codes is not None:
        assert run["codes"] == target_codes, "the official spec sampler's codes are not the target's greedy codes"
    assert codes == run["codes"], "codes differ from the official speculative sampler's"
    assert json.loads(stats.read_text())["fixed_at"] == run["fixed_at"], \
        "codes were accepted at other iterations than in the official sampler"


def expected_trees(case: str) -> dict:
    """``fixtures/<case>/expected_trees.json``: the official sampler drafting LANTERN's trees (build/trees.py)."""
    return json.loads((fixture(case) / "expected_trees.json").read_text())


def assert_tree_run(case: str, kind: str, model_args: list, tmp_path: Path) -> None:
    """``generate --decoder spec --drafts top --tree static|dynamic`` with the case's drafter, greedy: the codes of the
    official sampler drafting that tree (LANTERN's naive_extend_57 or its EAGLE-2 dynamic tree at its defaults; the
    target's greedy codes, those of the case's chain run) and each code fixed at the iteration where the official
    sampler fixed it (its accept lengths: the longest path of the target's codes, plus one)."""
    run = next(r for r in expected_trees(case)["runs"] if f" {kind} tree " in r["name"])
    assert run["codes"] == expected(case)["runs"][0]["codes"], "the official tree runs left the target's greedy codes"
    tokens, stats = tmp_path / "t.json", tmp_path / "s.json"
    r = fastar("generate", *model_args, "--drafter", fixture(case) / "drafter", *run["args"], "--quiet",
               "--tokens-out", tokens, "--stats-out", stats, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert generated_codes(tokens) == run["codes"], f"{kind} tree: codes differ from the official speculative sampler's"
    fixed_at = json.loads(stats.read_text())["fixed_at"]
    for image, (ours, official) in enumerate(zip(fixed_at, run["fixed_at"])):
        first = next((i for i, (a, b) in enumerate(zip(ours, official)) if a != b), None)
        assert first is None, (f"{kind} tree, image {image}: code {first} fixed at iteration {ours[first]}, the "
                               f"official sampler fixed it at {official[first]} ({max(ours)} target forwards, "
                               f"official {max(official)})")
