"""A bundled model samples at its own best measured settings, read from its file (a release keeps the release's),
a run that keeps almost none of its drafts says so and what to use instead, and a Jacobi window picked by hand on
a CPU says what a window costs there."""
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from fastar.errors import FastARError
from fastar.model_loaders import load_ar_model
from fastar.model_loaders.shared.demo import DEMO_AR, DEMO_MAR, DEMO_VAR
from fastar.samplers.decoders import warn_of_low_acceptance
from fastar.samplers.few_step_loops.next_scale import VAR_SAMPLING
from fastar.samplers.stats import DecodeStats
from fastar.settings import NO_FLAGS, masked_settings_from, sampling_from


def test_the_bundled_mar_and_var_sample_at_their_own_settings_unless_told():
    mar, var = load_ar_model(DEMO_MAR), load_ar_model(DEMO_VAR)
    own = masked_settings_from(NO_FLAGS, mar)
    assert (own.num_iter, own.cfg_scale, own.diffusion_steps) == (32, 3.0, 50)
    told = masked_settings_from(SimpleNamespace(num_iter=8, cfg=1.5, diffusion_steps=None), mar)
    assert (told.num_iter, told.cfg_scale, told.diffusion_steps) == (8, 1.5, 50)  # flags win, one by one
    sampling = sampling_from(NO_FLAGS, var, VAR_SAMPLING)
    assert (sampling.cfg_scale, sampling.top_k, sampling.top_p) == (1.5, 0, 0.7)
    assert sampling_from(SimpleNamespace(top_p=1.0), var, VAR_SAMPLING).top_p == 1.0  # 1 given means off
    assert load_ar_model(DEMO_AR).defaults == {}  # the class demo's are the family's


def test_a_release_keeps_the_releases_defaults(tmp_path):
    from tiny_mar import mar_config, official_mar

    official_mar(tmp_path / "mar.pth", mar_config(), seed=0, num_heads=2)
    own = masked_settings_from(NO_FLAGS, load_ar_model(tmp_path / "mar.pth"))
    assert (own.num_iter, own.cfg_scale, own.diffusion_steps) == (64, 2.0, 100)


@pytest.mark.parametrize("defaults, message", [("{not json", "not valid JSON"),
                                               ('{"cfg": 3, "steps": 9}', "steps, which no FastAR setting")])
def test_broken_defaults_in_a_file_are_refused_with_the_reason(tmp_path, defaults, message):
    from safetensors import safe_open

    with safe_open(DEMO_MAR, "pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())
    save_file(tensors, tmp_path / "mar.safetensors", metadata={**metadata, "fastar_defaults": defaults})
    with pytest.raises(FastARError, match=message):
        load_ar_model(tmp_path / "mar.safetensors")


def stats_with(drafted: int, accepted: int, decoder="spec") -> DecodeStats:
    return DecodeStats(decoder=decoder, grid=(4, 4), batch=1, drafted_tokens=drafted, accepted_tokens=accepted)


def test_a_run_that_keeps_almost_no_drafts_says_so_and_what_to_use_instead():
    low = stats_with(200, 6, "cspd")
    with pytest.warns(UserWarning, match=r"cspd kept 3\.0% of its 200 drafts.*plain MAR with fewer steps"):
        warn_of_low_acceptance(low)
    assert low.warnings and "fewer steps" in low.warnings[0]
    for quiet in (stats_with(200, 10), stats_with(10, 0), stats_with(0, 0, "ar")):  # 5%, too few drafts, none
        warn_of_low_acceptance(quiet)
        assert not quiet.warnings


def fastar(*args, cwd):
    return subprocess.run([sys.executable, "-m", "fastar", "generate", "--quiet", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=900)


def test_cspd_on_the_demo_says_its_drafts_are_rejected(tmp_path):
    r = fastar("--model", DEMO_MAR, "--decoder", "cspd", "--class", 5, "--num-iter", 8, "--diffusion-steps", 5,
               "--stats-out", tmp_path / "s.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "warning: cspd kept 0.0% of its" in r.stderr and "plain MAR with fewer steps" in r.stderr
    assert json.loads((tmp_path / "s.json").read_text())["warnings"]


def test_sjd_picked_by_hand_on_a_cpu_says_what_a_window_costs_here(tmp_path):
    r = fastar("--decoder", "sjd", "--class", 1, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    note = next(line for line in r.stderr.splitlines() if line.startswith("note: on cpu a forward over 16 tokens"))
    assert "one-token forwards (measured now)" in note and "--decoder auto" in note
    quiet = fastar("--decoder", "ar", "--class", 1, cwd=tmp_path)
    assert "a forward over" not in quiet.stderr
