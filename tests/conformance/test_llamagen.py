"""LlamaGen family against its official code: the fixtures were made by FoundationVision/LlamaGen (c2i, t2i),
microsoft/distilled_decoding (LlamaGen-DD) and jadohu/LANTERN (the LlamaGen drafter); see build/llamagen.py.
FastAR runs as a user runs it and must give the official greedy codes exactly and the official decoder's images."""
from __future__ import annotations

from pathlib import Path

import pytest

from fastar.tests.conformance.common import (assert_image_close, assert_spec_run, assert_tree_run, expected, fastar,
                                             fixture, generated_codes, session_drafts)

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


def test_t2i_greedy_ar_and_sjd_give_the_official_codes_and_images(tmp_path):
    """Text-to-image: caption features from the T5 folder as the official T5Embedder and sample_t2i.py make them
    (left padding and mask), the null caption under CFG 7.5."""
    folder = fixture("llamagen_t2i")
    run_case("llamagen_t2i", ["--model", folder / "gpt.pt", "--vq", shared_vq(), "--t5", folder / "t5"], tmp_path)


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


LANTERN = "llamagen_lantern"


def test_lantern_drafter_drafts_what_the_official_drafter_drafts():
    """The LANTERN LlamaGen drafter folder (config.json + pytorch_model.bin) bound to its target: over the
    target's hidden states and the official greedy codes, every row's greedy draft (CFG-combined) is the
    official Model.forward's, and the sampled rows' logits agree to 1e-4."""
    import numpy as np
    import torch

    from fastar.model_loaders import load_ar_model
    from fastar.model_loaders.drafters.loader import load_drafter
    from fastar.model_loaders.drafters.teacher import teacher_rows
    from fastar.model_loaders.shared.protocol import ClassConditioning

    folder, run = fixture(LANTERN), expected(LANTERN)["runs"][0]
    target = load_ar_model(folder / "gpt.pt")
    drafter = load_drafter(folder / "drafter", target)
    codes = torch.tensor(run["codes"])
    labels = torch.tensor([int(c) for c in run["args"][run["args"].index("--classes") + 1].split(",")])
    cfg = float(run["args"][run["args"].index("--cfg") + 1])
    with torch.no_grad():
        conditioning = ClassConditioning(torch.cat([labels, labels]))
        drop = torch.arange(2 * len(labels)) >= len(labels)  # the cond rows, then the uncond rows
        rows = teacher_rows(target, drafter.token_ids, conditioning, torch.cat([codes, codes]), drop)
        logits = drafter.logits(drafter.training_features(rows))
    cond, uncond = logits.chunk(2)
    combined = uncond + (cond - uncond) * cfg
    assert combined.argmax(-1).tolist() == run["drafts"], "greedy drafts differ from the official drafter's"
    np.testing.assert_allclose(combined[:, run["drafter_logit_rows"]].numpy(), np.load(folder / "drafter_logits.npy"),
                               rtol=0, atol=1e-4)


def test_lantern_drafter_greedy_spec_gives_the_official_codes_and_acceptance(tmp_path):
    """Greedy speculative decoding with the drafter: the target's official greedy codes, each fixed at the
    iteration where the official drafter's chains (topK_genrate, top-1) let it be fixed."""
    import json

    folder, run = fixture(LANTERN), expected(LANTERN)["runs"][0]
    tokens, stats = tmp_path / "t.json", tmp_path / "s.json"
    r = fastar("generate", "--model", folder / "gpt.pt", "--drafter", folder / "drafter", *run["args"], "--quiet",
               "--tokens-out", tokens, "--stats-out", stats, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert generated_codes(tokens) == run["codes"], "codes differ from the target's official greedy codes"
    assert json.loads(stats.read_text())["fixed_at"] == run["fixed_at"], \
        "tokens were accepted at other iterations than with the official drafter's chains"


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_lantern_drafter_greedy_trees_give_the_official_codes_and_acceptance(kind, tmp_path):
    """``--drafts top --tree static`` (LANTERN++'s naive_extend_57) and ``--tree dynamic`` (EAGLE-2's tree at LANTERN's
    defaults: depth 4 = 5 deep, top_k 10, total_token 59 = 58 drafts), greedy: the target's greedy codes, each fixed
    at the iteration where LANTERN's topK_genrate_v1 / topK_genrate trees and evaluate_posterior(_v1) fixed it."""
    assert_tree_run(LANTERN, kind, ["--model", fixture(LANTERN) / "gpt.pt"], tmp_path)


LANTERN_T2I = "llamagen_t2i_lantern"


def test_lantern_t2i_drafter_drafts_what_the_official_drafter_drafts():
    """LANTERN's LlamaGen text-to-image drafter folder on a target saved by LANTERN's own LlamaGen class (the
    converted LlamaGen-T2I layout), both prompts in one batch with the null-caption rows: the drafter replays the
    119 caption slots (token 0, no RoPE, padded slots not hidden, as the release runs) and then the image rows;
    every greedy draft is the official drafter's and the sampled rows' CFG-combined logits agree to 1e-4."""
    import numpy as np
    import torch

    from fastar.model_loaders import load_ar_model
    from fastar.model_loaders.drafters.loader import load_drafter
    from fastar.model_loaders.llamagen.t5 import encode_captions, load_t5_encoder

    folder, run = fixture(LANTERN_T2I), expected(LANTERN_T2I)["runs"][0]
    args = run["args"]
    prompts = [args[i + 1] for i, a in enumerate(args) if a == "--prompt"]
    model = load_ar_model(folder / "LlamaGen-T2I")
    drafter = load_drafter(folder / "drafter", model)
    conditioning = encode_captions(load_t5_encoder(fixture("llamagen_t2i") / "t5"), prompts)
    logits = session_drafts(model, drafter, conditioning, torch.tensor(run["codes"]),
                            float(args[args.index("--cfg") + 1]))
    assert logits.argmax(-1).tolist() == run["drafts"], "greedy drafts differ from the official drafter's"
    np.testing.assert_allclose(logits[:, run["drafter_logit_rows"]].numpy(), np.load(folder / "drafter_logits.npy"),
                               rtol=0, atol=1e-4)


def test_lantern_t2i_greedy_spec_gives_the_official_codes_and_acceptance(tmp_path):
    """``--decoder spec`` with the drafter, greedy: the codes and acceptance of LANTERN's EaModel.generate (a chain
    of 4 drafts per target forward); its codes are its target class's own greedy codes (checked by the builder)."""
    folder = fixture(LANTERN_T2I)
    assert_spec_run(LANTERN_T2I, ["--model", folder / "LlamaGen-T2I", "--t5", fixture("llamagen_t2i") / "t5"],
                    tmp_path)


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_lantern_t2i_greedy_trees_give_the_official_codes_and_acceptance(kind, tmp_path):
    """LANTERN's EaModel.generate with static_tree True (naive_extend_57) and False (its dynamic tree at its
    defaults), greedy: FastAR's ``--tree static`` / ``--tree dynamic`` give its codes and its accept lengths."""
    folder = fixture(LANTERN_T2I)
    assert_tree_run(LANTERN_T2I, kind, ["--model", folder / "LlamaGen-T2I", "--t5", fixture("llamagen_t2i") / "t5"],
                    tmp_path)


def test_zipar_reference_attention_gives_the_official_codes_and_schedule(tmp_path):
    """ZipAR (ThisisBillhe/ZipAR's LlamaGen and sampler) at two windows: FastAR's zipar with the reference's
    attention gives its greedy codes exactly, in as many forwards (its schedule and its row-start stand-in)."""
    import json

    case = "llamagen_zipar"
    for run in expected(case)["runs"]:
        tag = run["name"].replace(" ", "_")
        tokens, stats = tmp_path / f"{tag}.json", tmp_path / f"{tag}_stats.json"
        r = fastar("generate", "--model", fixture(case) / "gpt.pt", "--vq", shared_vq(), *run["args"], "--quiet",
                   "--tokens-out", tokens, "--stats-out", stats, cwd=tmp_path)
        assert r.returncode == 0, f"{run['name']}: {r.stderr}"
        assert generated_codes(tokens) == run["codes"], f"{run['name']}: codes differ from the official sampler's"
        assert json.loads(stats.read_text())["target_forwards"] == run["forwards"]

