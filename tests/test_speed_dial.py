"""The speed dial (speed_dial.py): each level admits only what its quality bounds allow and picks the fastest on the
device as priced, lossless falls back to plain sampling where a window costs more than it saves, every kind gets
its own sampler's settings, and the command line says what it picked and why."""
import json
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from fastar import speed_dial
from fastar.commands.bench.decoders import forward_width
from fastar.errors import FastARError
from fastar.model_loaders.shared.demo import DEMO_AR, DEMO_DD, DEMO_MAR, DEMO_VAR
from fastar.model_loaders.shared.protocol import ClassConditioning
from fastar.pipeline import load_models
from fastar.samplers.masked_loops.masked import MaskedSettings
from fastar.speed_dial import (BOUNDS, CPU_PRICING, GPU_PRICING, SPEEDS, TOKEN_CANDIDATES, WindowPricing, choose,
                               pick)

ROOT = speed_dial.__file__.rsplit("/", 1)[0]
AR = TOKEN_CANDIDATES[0]
UNDRAFTED = [c for c in TOKEN_CANDIDATES if not c.drafter]


def within_bounds(speed, candidate):
    if candidate.lossless:
        return True
    points, ratio = BOUNDS.get(speed, (0, 0))
    return speed != "lossless" and candidate.accuracy >= AR.accuracy - points and candidate.frechet <= ratio * AR.frechet


@pytest.mark.parametrize("pricing", [GPU_PRICING, CPU_PRICING], ids=["gpu", "cpu"])
@pytest.mark.parametrize("drafted", [False, True])
def test_each_level_picks_the_fastest_it_admits(pricing, drafted):
    candidates = TOKEN_CANDIDATES if drafted else UNDRAFTED
    speed_of = (lambda c: c.steps) if pricing.flat else (lambda c: c.cpu_speedup)
    picked = {}
    for speed in SPEEDS:
        choice = pick(list(candidates), speed, pricing, "cuda" if pricing.flat else "cpu")
        chosen = choice.candidate
        assert within_bounds(speed, chosen) and (drafted or not chosen.drafter)
        fitting = [c for c in candidates if within_bounds(speed, c) and (not pricing.flat or c.width <= 32)]
        assert speed_of(chosen) == max(map(speed_of, fitting)) or chosen is AR  # lossless may fall back to AR
        assert chosen.label in choice.why or chosen is AR
        picked[speed] = chosen
    assert speed_of(picked["lossless"]) <= speed_of(picked["balanced"]) <= speed_of(picked["fast"])


def test_lossless_on_a_cpu_is_plain_ar_where_a_window_costs_more_than_it_saves():
    choice = pick(UNDRAFTED, "lossless", CPU_PRICING, "cpu")
    assert choice.candidate is AR and "plain sampling is the pick" in choice.why
    cheap = WindowPricing({1: 1.0, 16: 1.05, 32: 1.1}, flat=False)  # a CPU whose windows are nearly free
    assert pick(UNDRAFTED, "lossless", cheap, "cpu").candidate.decoder == "sjd"
    on_gpu = pick(UNDRAFTED, "lossless", GPU_PRICING, "cuda").candidate
    assert on_gpu.decoder == "sjd" and on_gpu.lossless and on_gpu.steps > 2


def test_a_relaxed_candidate_outside_the_bounds_is_never_picked():
    ruinous = replace(TOKEN_CANDIDATES[-1], label="ruinous", steps=50.0, cpu_speedup=50.0, accuracy=10.0, width=1)
    for pricing in (GPU_PRICING, CPU_PRICING):
        for speed in SPEEDS:
            assert pick([*UNDRAFTED, ruinous], speed, pricing, "x").candidate is not ruinous
    good = replace(ruinous, label="good", accuracy=AR.accuracy, frechet=AR.frechet)
    assert pick([*UNDRAFTED, good], "balanced", GPU_PRICING, "cuda").candidate is good


def test_every_candidate_builds_valid_settings():
    for candidate in TOKEN_CANDIDATES:
        speed_dial.Choice("fast", candidate, "").spec().validate()
        assert candidate.width == forward_width(candidate, (16, 16)), candidate.label  # what the GPU pricing reads
    demo = MaskedSettings(num_iter=32, cfg_scale=3.0, diffusion_steps=50)
    for candidate in speed_dial.MAR_CANDIDATES:
        settings = speed_dial.Choice("fast", candidate, "").masked(demo).validate(64)
        assert settings.num_iter == round(32 * candidate.settings.get("steps", 1.0))
        assert settings.cfg_scale == 3.0 and settings.diffusion_steps == 50  # the model's own, kept


@pytest.fixture(scope="module")
def class_demo():
    return load_models(str(DEMO_AR), None, "cpu", drafter_path="demo")


def test_a_windows_cost_is_measured_once_per_model_for_the_note(class_demo, monkeypatch):
    rows = ClassConditioning(torch.tensor([0]))
    speed_dial.PRICES.clear()
    first = speed_dial.measured_pricing(class_demo.ar, rows)
    assert first.measured and first.costs[1] == 1.0 and set(first.costs) == set(speed_dial.PRICED_WIDTHS)
    assert first.costs[32] > first.costs[1]  # a 32-token forward is never cheaper than a one-token one
    monkeypatch.setattr(speed_dial, "window_costs", lambda *a, **k: pytest.fail("measured twice"))
    assert speed_dial.measured_pricing(class_demo.ar, rows) is first
    speed_dial.PRICES.clear()


def test_the_pick_depends_on_the_device_and_nothing_timed(class_demo, monkeypatch):
    monkeypatch.setattr(speed_dial, "window_costs", lambda *a, **k: pytest.fail("the dial timed a forward"))
    on = {device: SimpleNamespace(kind="token-ar", device=torch.device(device)) for device in ("cpu", "cuda", "mps")}
    assert choose(on["cpu"], "lossless").decoder == "ar"  # on a CPU a window costs more than SJD saves
    assert choose(on["cuda"], "lossless").decoder == "sjd" and choose(on["mps"], "lossless").decoder == "sjd"
    assert choose(on["cuda"], "fast", class_demo.drafter).decoder == "lantern"
    assert choose(on["cuda"], "fast", class_demo.drafter, codebook=False).decoder != "lantern"  # needs the codebook
    assert choose(class_demo.ar, "balanced") == choose(class_demo.ar, "balanced")


def test_other_kinds_get_their_own_samplers_picks():
    mar = SimpleNamespace(kind="masked-ar", device=torch.device("cpu"))
    picks = {speed: choose(mar, speed).candidate for speed in SPEEDS}
    assert picks["lossless"] is speed_dial.MAR_CANDIDATES[0]  # plain MAR at the model's own steps
    assert all(p.decoder == "ar" for p in picks.values())
    assert picks["balanced"].cpu_speedup <= picks["fast"].cpu_speedup and picks["fast"].cpu_speedup > 1.5
    var = choose(SimpleNamespace(kind="next-scale", device=torch.device("cpu")), "fast")
    assert var.decoder == "ar" and "only one" in var.why
    kept = {speed: choose(mar, speed, keep_steps=True).candidate for speed in SPEEDS}  # --num-iter given
    assert all(c.settings.get("steps", 1.0) == 1.0 for c in kept.values()) and kept["fast"].settings.get("reuse")
    student = SimpleNamespace(kind="few-step", device=torch.device("cpu"))
    assert [choose(student, s).dd_steps for s in SPEEDS] == [2, 2, 1]


def test_an_unknown_speed_is_refused():
    with pytest.raises(FastARError, match="speed 'quick'"):
        choose(SimpleNamespace(kind="token-ar"), "quick")


def generate(*args, cwd):
    return subprocess.run([sys.executable, "-m", "fastar", "generate", "--quiet", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize("model, speed, decoders", [
    (DEMO_AR, "lossless", ("ar",)),  # a CPU: a window costs more than SJD saves
    (DEMO_MAR, "balanced", ("ar+reuse",)),
    (DEMO_VAR, "fast", ("ar",)),
    (DEMO_DD, "fast", ("dd",)),
])
def test_the_command_line_says_what_the_dial_picked_and_why(tmp_path, model, speed, decoders):
    stats_file = tmp_path / "stats.json"
    r = generate("--model", model, "--speed", speed, "--class", 5, "--stats-out", stats_file, "--diffusion-steps", 5,
                 cwd=tmp_path) if model == DEMO_MAR else \
        generate("--model", model, "--speed", speed, "--class", 5, "--stats-out", stats_file, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    said = [line for line in r.stdout.splitlines() if line.startswith(f"speed dial, {speed}: ")]
    stats = json.loads(stats_file.read_text())
    assert said and stats["decoder"] in decoders and stats["settings"]["dial"]["speed"] == speed
    if model == DEMO_AR:  # a CPU, priced as the one the latencies were measured on: always plain sampling
        assert stats["decoder"] == "ar" and "plain sampling is the pick" in said[0]
    assert stats["settings"]["dial"]["why"] in said[0] and stats["settings"]["dial"]["picked"]
    if model == DEMO_MAR:  # half its own 32 steps, feature reuse on
        assert stats["target_forwards"] == 16
    if model == DEMO_DD:
        assert stats["target_forwards"] == 1


def test_speed_goes_with_the_dial_only(tmp_path):
    r = generate("--decoder", "sjd", "--speed", "fast", cwd=tmp_path)
    assert r.returncode == 2 and "--speed fast picks a decoder for you" in r.stderr
