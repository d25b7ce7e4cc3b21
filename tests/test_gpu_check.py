"""The GPU check script (commands/gpu_check.py) on the CPU: what it can run without a GPU runs here, so that the few
minutes of a lent GPU are not spent finding the script's own faults. ``--device cpu`` makes its "GPU" steps CPU
runs: they must equal the CPU references, the conformance run the official codes, and a difference must show."""
import json
import subprocess
import sys

import numpy as np
import torch

from fastar.cli import build_parser
from fastar.commands.gpu_check import (PROBES, Step, correctness_steps, goal_lines, judge, kernel_lines,
                                       latents_path, probe_and_profile_steps)


def check_verdicts(out, only: str, workers: int, budget: int = 900) -> dict:
    """Run the check's steps named in ``only`` on the CPU; each step's verdict."""
    done = subprocess.run([sys.executable, "-m", "fastar.commands.gpu_check", "--device", "cpu", "--out", out,
                           "--only", only, "--workers", str(workers), "--budget", str(budget)], capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "report.json").read_text())
    return {step["name"]: step["verdict"] for step in report["steps"]}


def test_the_check_runs_its_steps_and_reports_exact_codes(tmp_path):
    verdicts = check_verdicts(tmp_path, "llamagen-c2i-ar-greedy-cpu,llamagen-c2i-ar-greedy-gpu-fp32,conformance-var", 2)
    assert verdicts == {"llamagen-c2i-ar-greedy-cpu": "ran", "llamagen-c2i-ar-greedy-gpu-fp32": "exact",
                        "conformance-var-0": "exact"}, verdicts
    assert "| conformance-var-0 | conformance-on-gpu | exact |" in (tmp_path / "report.md").read_text()


def test_a_short_budget_still_runs_the_chosen_correctness_steps(tmp_path):
    # the time kept back for the timed profiles is kept only when one of them was chosen
    assert check_verdicts(tmp_path, "llamagen-c2i-ar-greedy-cpu", 1, budget=60) == {"llamagen-c2i-ar-greedy-cpu": "ran"}


def test_every_step_is_a_command_that_parses(tmp_path):
    """A typo in a step's arguments would cost a lent GPU's minutes: every step's command line must parse."""
    steps = correctness_steps(tmp_path, "cuda") + probe_and_profile_steps(tmp_path, "cuda", "LlamaGen")
    assert len({step.name for step in steps}) == len(steps)
    parser = build_parser()
    for step in steps:
        argv = [str(a) for a in step.argv]
        assert argv[:2] == [sys.executable, "-m"], step.name
        if argv[2] == "fastar":
            parser.parse_args(argv[3:])  # exits (SystemExit) on an unknown option or a bad choice
        else:
            assert argv[2] == "fastar.commands.gpu_check" and argv[argv.index("--probe") + 1] in PROBES, step.name


def test_codes_that_differ_are_reported_with_their_share_and_first_position(tmp_path):
    (tmp_path / "tokens").mkdir()
    for name, codes in (("ref", [[1, 2, 3, 4]]), ("same", [[1, 2, 3, 4]]), ("other", [[1, 2, 9, 9]])):
        (tmp_path / "tokens" / f"{name}.json").write_text(json.dumps({"tokens": codes}))
    steps = [Step(name, [], "g", compare) for name, compare in
             (("ref", {}), ("same", {"step": "ref"}), ("other", {"step": "ref"}), ("official", {"codes": [[1, 2, 3, 5]]}))]
    (tmp_path / "tokens" / "official.json").write_text(json.dumps({"tokens": [[1, 2, 3, 4]]}))
    for step in steps:
        step.rc, step.verdict = 0, "ran"
    judge(steps, tmp_path)
    assert [s.verdict for s in steps] == ["ran", "exact", "DIFFERS (50.0% agree, first at 2)",
                                          "DIFFERS (75.0% agree, first at 3)"]


def test_mars_compiled_reverse_steps_are_judged_by_how_close_their_latents_come(tmp_path):
    verdicts = check_verdicts(tmp_path, "mar-ar-gpu-", 1)
    assert verdicts["mar-ar-gpu-eager"] == "ran" and verdicts["mar-ar-gpu-compiled"].startswith("close ("), \
        verdicts
    eager = np.load(latents_path(tmp_path, "mar-ar-gpu-eager"))
    forked = eager.copy()
    forked[0] = eager[1]  # an image whose tokens went elsewhere, as rounding can send one (commands/gpu_check.py)
    shifted = eager + 2e-3 * np.abs(eager).mean()  # every latent a little off, as a wrong compiled step puts them
    for name, latents in (("forked", forked), ("shifted", shifted)):
        np.save(latents_path(tmp_path, name), latents)
    steps = [Step("mar-ar-gpu-eager", [], "g"), *(Step(name, [], "g", {"latents": "mar-ar-gpu-eager"})
                                                  for name in ("forked", "shifted", "missing"))]
    for step in steps:
        step.rc = 0
    judge(steps, tmp_path)
    assert steps[1].verdict.startswith("close (0.0e+00 apart, mean ") and not steps[1].verdict.endswith(" 0.0e+00)")
    assert [s.verdict for s in steps[2:]] == ["DIFFERS (2.0e-03 apart, mean 2.0e-03)", "no reference"]


def test_the_report_states_the_speed_goals():
    entry = {"floor_ms": 4.0, "forward_ms": {"1": 6.0}, "forward_over_floor": 1.5,
             "decoders": {"ar": {"image_s": 8.0, "target_forwards": 1024, "over_floor": 1.6},
                          "sjd": {"image_s": 4.0, "target_forwards": 400, "over_floor": 1.75}}}
    mar = {"floor_ms": 2.0, "forward_ms": 9.0, "compiled_forward_ms": 3.0, "head_ms": 1, "head_process_ms": 120.0,
           "compiled_head": {"head_process_ms": 15.0, "speedup": 8.0, "apart": 0.0012}}
    lines = goal_lines({"profile-7b": {"batches": {"2": entry}}, "profile-mar": {"batches": {"1": mar}}})
    assert lines == ["- profile-7b, batch 2: forward 6.00 ms, 1.50x the 4.00 ms floor (misses 1.25x); iterations "
                     "against the floor: ar 1.60x, sjd 1.75x; sjd 2.00x faster than ar per image for 2.56x fewer "
                     "forwards (0.78 of it: misses 0.9)",
                     "- profile-mar, batch 1: a MAR step's reverse process 120.0 ms eagerly, 15.0 ms on compiled "
                     "steps (8.00x; latents 1.2e-03 apart); transformer call 9.0 ms eagerly, 3.0 ms compiled"]
    assert goal_lines({}) == ["- no token profile ran"]
    whole = goal_lines({"profile-7b": {"batches": {"2": {**entry, "whole_cache_forward_ms": 6.5}}}})
    assert whole[0].startswith("- profile-7b, batch 2: forward 6.00 ms, 1.50x the 4.00 ms floor (misses 1.25x), "
                               "6.50 ms attending over the whole cache; iterations"), whole
    timed = {"ms_per_iteration": 5.0, "image_s": 4.0, "target_forwards": 400, "over_floor": 1.25}
    compiled = {**entry, "decoders": {**entry["decoders"], "sjd": timed},
                "full_guards_decoders": {"sjd": {**timed, "ms_per_iteration": 5.5}},
                "eager_loop_step_decoders": {"sjd": {**timed, "ms_per_iteration": 6.25}}}
    assert goal_lines({"profile-xl-compiled": {"batches": {"2": compiled}}})[0].endswith(
        "; sjd 5.00 ms per iteration, with every call guarded in full 5.50 (0.91x), with sampling and verification "
        "eager 6.25 (0.80x)")
    streamed = goal_lines({"profile-7b-streamed": {"streamed_gb": 6.04, "host_bandwidth_gb_s": 24.6,
                                                   "batches": {"2": {**entry, "decoders": {}}}}})
    assert streamed[0].endswith("(misses 1.25x); 6.0 GB of weights streamed at 24.6 GB/s"), streamed
    janus = goal_lines({"side-by-side-janus": {"batches": {"1": {**entry, "baselines": {
        "transformers generate()": {"ar_speedup": 3.5}}}}}})
    assert janus[0].endswith("; ar 3.50x faster than transformers' generate (meets 3.0x)"), janus
    int8 = goal_lines({"profile-7b": {"batches": {"2": entry}},
                       "profile-7b-int8": {"batches": {"2": {**entry, "forward_ms": {"1": 3.5}}}}})
    assert int8[-1] == "- profile-7b-int8, batch 2: int8 step 3.50 ms, 1.71x the bf16 step (meets 1.6x)", int8


def test_the_report_says_where_a_forward_spends_its_time():
    k = {"wall_ms": 6.5, "busy_ms": 5.0, "busy_share": 5 / 6.5, "groups_ms": {"matmul": 4.0, "attention": 1.0},
         "top": [{"name": "sm90_xmma_gemm", "group": "matmul", "ms": 0.125, "calls": 4}],
         "dynamo_host_ms": {"guards": 0.0625, "inputs": 0.03125}}
    lines = kernel_lines({"profile-7b-compiled": {"batches": {"2": {"kernels": {"1": k, "16": k | {"top": []}}}}}})
    assert lines == ["- profile-7b-compiled, batch 2, W=1: 6.50 wall, 5.00 busy (matmul 4.00, attention 1.00); "
                     "busiest 0.125 sm90_xmma_gemm; dynamo on the host: guards 0.062, inputs 0.031",
                     "- profile-7b-compiled, batch 2, W=16: 6.50 wall, 5.00 busy (matmul 4.00, attention 1.00); "
                     "busiest 0.000 -; dynamo on the host: guards 0.062, inputs 0.031"]
    assert kernel_lines({"profile-mar": {"batches": {"2": {"head_ms": 1}}}}) == ["- no profile ran with --kernels"]


def test_the_accelerators_run_in_the_check_in_every_precision(tmp_path):
    """ZipAR and LazyMAR are a decoder and a switch: the check runs them as it runs every decoder (issue 36)."""
    names = "llamagen-c2i-zipar-sjd-bf16,lumina-text-zipar-fp16,mar-ar-reuse-bf16"
    assert check_verdicts(tmp_path, names, 2) == dict.fromkeys(names.split(","), "ran")
    stats = json.loads((tmp_path / "stats" / "mar-ar-reuse-bf16.json").read_text())
    assert stats["decoder"] == "ar+reuse" and stats["transformer_work"] < 1


def test_8_bit_and_zipar_steps_compile_to_the_eager_codes_in_the_check(tmp_path):
    names = ("llamagen-c2i-ar-greedy-gpu-int8,llamagen-c2i-ar-greedy-gpu-int8-compiled,"
             "llamagen-c2i-zipar-greedy-gpu-fp32,llamagen-c2i-zipar-greedy-gpu-compiled")
    assert check_verdicts(tmp_path, names, 1) == {
        "llamagen-c2i-ar-greedy-gpu-int8": "ran", "llamagen-c2i-ar-greedy-gpu-int8-compiled": "exact",
        "llamagen-c2i-zipar-greedy-gpu-fp32": "ran", "llamagen-c2i-zipar-greedy-gpu-compiled": "exact"}


def test_the_sync_probe_runs_every_decoder_and_counts_what_the_debug_mode_reports(monkeypatch):
    """The probe's own code on the CPU (sync debug mode is CUDA's: here it only records the switch, and a warning
    it would give is planted in one run), so that a GPU run does not find its faults."""
    import warnings

    import torch

    from fastar.commands import gpu_probes

    modes = []

    def debug_mode(mode):
        modes.append(mode)
        if mode == "warn" and len(modes) == 1:
            warnings.warn("called a synchronizing CUDA operation")

    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", debug_mode)
    counts = gpu_probes.probe_sync("cpu", None, images=1, mar_steps=4)  # the GPU's run: 4 images, 16 MAR steps
    assert set(counts) == {"ar", "sjd", "gsd", "spec", "zipar", "zipar-sjd", "mar-ar", "mar-cspd", "mar-reuse"}
    assert counts["ar"]["syncs"] == 1 and all(c["syncs"] == 0 for name, c in counts.items() if name != "ar")
    assert counts["mar-cspd"]["drafter_forwards"] > 0 and counts["spec"]["syncs_per_step"] == 0
    assert modes == ["warn", "default"] * 9


def test_the_8_bit_kernel_probe_runs_its_code_on_the_cpu():
    """The probe's own code with small shapes and the CUDA-graph timing stubbed (here the dequantised path runs,
    so its products are exact up to half-precision rounding)."""
    from fastar.commands import gpu_probes

    calls = []
    result = gpu_probes.probe_w8("cpu", None, shapes={"qkv": (64, 32), "down": (32, 64)},
                                 timed=lambda work: calls.append(len(work())) or 1.0)
    assert set(result["relative_error"]) == {f"{f} {d} rows {r}" for f in ("int8", "fp8")
                                             for d in ("bfloat16", "float16") for r in (1, 4, 64)}
    assert max(result["relative_error"].values()) < 1e-2
    assert result["int8_fused"] is False and calls == [2] * 10  # 5 variants x 2 row counts, both linears each
    assert result["int8_tiles_ms"] == {}  # the tiles are the fused kernel's, which runs on a GPU (tile_times below)
    assert set(result["ms_per_block_linears"]) == {f"{v} rows {r}" for v in ("bf16", "int8", "int8 dequantised",
                                                                            "fp8", "fp8 dequantised") for r in (4, 64)}


def test_the_inductor_8_bit_probe_compiles_its_product_and_times_three_arms_on_the_cpu():
    """The probe's own code with small shapes, the CUDA-graph timing stubbed and no autotuning: its compiled
    product is the dequantised one up to bf16 rounding, and each arm runs every linear at both row counts."""
    from fastar.commands import gpu_probes

    calls = []
    result = gpu_probes.probe_w8_inductor("cpu", None, shapes={"qkv": (64, 32), "down": (32, 64)},
                                          timed=lambda work: calls.append(len(work())) or 1.0, mode="default")
    assert result["relative_error"] < 1e-2 and result["mode"] == "default"
    assert calls == [2] * 6 and set(result["ms_per_block_linears"]) == {
        f"{arm} rows {rows}" for arm in ("inductor int8", "inductor bf16", "int8 as FastAR runs it") for rows in (4, 64)}


def test_the_tile_sweep_times_every_tile_that_divides_the_weights(monkeypatch):
    """The w8 probe's tile sweep (gpu_probes.tile_times) with the kernel stubbed: each of TILES whose N and K
    tiles divide every weight, passed to the kernel as its blocks."""
    from types import SimpleNamespace

    from fastar.commands import gpu_probes
    from fastar.model_loaders.shared.kernels import w8_matmul

    seen = []
    monkeypatch.setattr(w8_matmul, "fused_matmul", lambda x, codes, scale, bias, blocks: seen.append(blocks) or x)
    layer = SimpleNamespace(out_features=96, in_features=256, weight=None, weight_scale=None)
    times = gpu_probes.tile_times({"a": layer}, {"a": torch.zeros(4, 256)}, lambda work: len(work()) / 4)
    assert times == {"16x16x256": 0.25, "16x32x256": 0.25, "16x32x128": 0.25, "64x32x128": 0.25}  # 96 outputs: N tiles
    assert [(b["BLOCK_M"], b["BLOCK_N"], b["BLOCK_K"]) for b in seen] == [  # of 16 and 32 divide them, not of 64
        (16, 16, 256), (16, 32, 256), (16, 32, 128), (64, 32, 128)]


def test_the_report_compares_the_fused_layers_with_inductors():
    from fastar.commands.gpu_check import fused_layer_lines

    probe = {"floor_ms": 3.9, "relative_difference": {"rows 4": 0.0021},
             "ms_per_step": {"torch compiled rows 4": 5.0, "fused rows 4": 4.0},
             "fused_tiles_ms": {"rows 4": {"16x64x128": 4.0, "16x32x128": 3.8}, "rows 64": "the tiles do not divide"}}
    assert fused_layer_lines(probe) == [
        "- rows 4: torch compiled 5.000 ms, fused 4.000 ms (1.25x) against a 3.900 ms floor; outputs 2.1e-03 apart; "
        "fastest tiles 16x32x128: 3.800 ms", "- rows 64: the tiles do not divide"]
    assert fused_layer_lines(None) == ["- the fused-layer probe did not run"]
