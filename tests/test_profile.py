"""``python -m fastar profile`` on the CPU (the smoke run CI can do; the GPU figures need a GPU): the report's
floor is the bytes a forward must read over the measured bandwidth, every window and decoder is timed, and a
shape it does not know is refused with the list."""
import json
import subprocess
import sys
from math import prod
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from fastar.errors import FastARError
from fastar.samplers.masked_loops.feature_reuse import FeatureReuse

from fastar.cli import build_parser
from fastar.commands.profile.speed import build, kv_bytes_read, run_profile, weight_bytes_read


def profile_args(**fields) -> SimpleNamespace:
    """The profile command's arguments as its parser gives them, with ``fields`` set."""
    return SimpleNamespace(**(vars(build_parser().parse_args(["profile"])) | fields))


def test_the_floor_counts_the_weights_and_the_filled_cache():
    model = build("tiny", torch.device("cpu"), torch.float16)
    params = sum(p.numel() for p in model.parameters())
    embedding = model.tok_embeddings.weight.numel()
    assert weight_bytes_read(model) == 2 * (params - embedding - model.cls_embedding.embedding_table.weight.numel())
    cfg = model.cfg
    assert kv_bytes_read(model, rows=4, filled=10) == 4 * cfg.n_layer * 2 * cfg.n_kv_head * cfg.head_dim * 10 * 2


@pytest.mark.parametrize("compiled", [False, True])
def test_a_cpu_profile_times_every_window_and_decoder(tmp_path, compiled):
    out = tmp_path / "profile.json"
    batches = [1] if compiled else [1, 2]  # compiling costs seconds per shape
    mode = "reduce-overhead" if compiled else None  # CUDA's mode (its static caches, copied outputs), on a CPU
    args = profile_args(shape="tiny", device="cpu", dtype=None, windows="1,4,16", batches=batches, repeats=2,
                           no_decoders=False, out=str(out), compile=compiled, compile_mode=mode, model=None, grid=None,
                           drafter=None, baselines=False, gpu_weights=None, weights="auto", memory=False, kernels=False)
    report = run_profile(args)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["dtype"] == "fp32" and report["bandwidth_gb_s"] > 0
    assert report["compiled"] == mode
    assert ("eager" in report["batches"]["1"]) == compiled  # the eager twin, timed beside the compiled steps
    for batch in map(str, batches):
        entry = report["batches"][batch]
        assert set(entry["forward_ms"]) == {"1", "4", "16"} and entry["window_cost"]["1"] == 1.0
        assert entry["floor_ms"] > 0 and entry["forward_over_floor"] == entry["forward_ms"]["1"] / entry["floor_ms"]
        assert entry["decoders"]["ar"]["target_forwards"] == 63  # 8 x 8 tokens, the first from the prefill
        assert entry["decoders"]["sjd"]["target_forwards"] < 63 and entry["decoders"]["gsd"]["over_floor"] > 0
        assert entry["decoders"]["spec"]["ms_per_iteration"] > 0  # drafted by a random 2-layer model of the shape
        if compiled:  # the evidence for turning compiled steps on: same tokens, logits within float noise
            assert set(entry["eager"]["decoders"]) == set(entry["decoders"]) == {"ar", "sjd", "gsd", "spec"}
            assert entry["eager"]["same_tokens"] == {"ar": True, "sjd": True, "gsd": True, "spec": True}
            assert set(entry["eager"]["max_logit_gap"]) == {"1", "4", "16"}
            assert all(0 <= gap < 1e-4 for gap in entry["eager"]["max_logit_gap"].values())
            assert set(entry["full_guards_forward_ms"]) == {"1", "4", "16"}  # timed again, guards in full
            assert set(entry["full_guards_decoders"]) == {"sjd"} and entry["full_guards_decoders"]["sjd"]["same_tokens"]
            eager_steps = entry["eager_loop_step_decoders"]["sjd"]  # the same draws, so the same tokens
            assert eager_steps["same_tokens"] and eager_steps["target_forwards"] == entry["decoders"]["sjd"]["target_forwards"]
    if compiled:  # no step split by a graph break (the graphs may come from the kernel cache of an earlier test)
        assert report["dynamo"]["graph_breaks"] == {}
    assert report["drafter"] == "small-ar"


def test_a_streamed_profile_counts_the_streamed_weights_at_the_host_bandwidth(monkeypatch):
    """--gpu-weights on the CPU (its GPU-only check lifted, a host bandwidth planted): the floor adds the streamed
    bytes at the host-to-device bandwidth to the rest at the device's."""
    from fastar.commands.profile import speed as speed_profile

    monkeypatch.setattr(speed_profile, "check_gpu_weights", lambda gpu_weights, device: None)
    monkeypatch.setattr(speed_profile, "host_bandwidth", lambda timing: 1e6)  # 1 MB/s: the streamed part dominates
    args = profile_args(shape="tiny", device="cpu", dtype=None, windows="1", batches=[1], repeats=1,
                           no_decoders=True, out=None, compile=False, compile_mode=None, model=None, grid=None,
                           drafter=None, baselines=False, gpu_weights=0, weights="auto", memory=False, kernels=False)
    report = run_profile(args)
    streamed = report["streamed_gb"] * 1e9
    assert report["host_bandwidth_gb_s"] == 1e-3 and streamed > 0
    assert report["batches"]["1"]["floor_ms"] == pytest.approx(streamed / 1e6 * 1e3, rel=0.05)
    with pytest.raises(FastARError, match="compiled steps are off while weights stream"):
        run_profile(SimpleNamespace(**{**vars(args), "compile": True}))


def test_an_unknown_shape_is_refused_with_the_choices():
    r = subprocess.run([sys.executable, "-m", "fastar", "profile", "--shape", "gpt-5"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and "--shape gpt-5: choose one of tiny, demo, llamagen-b" in r.stderr


def test_a_checkpoint_is_profiled_and_a_var_refused(tmp_path):
    from fastar.model_loaders.shared.demo import DEMO_AR, DEMO_VAR

    args = profile_args(shape="demo", model=str(DEMO_AR), device="cpu", dtype=None, windows="1,4", batches=[1],
                           repeats=1, no_decoders=False, out=None, compile=False, grid=None, drafter="demo",
                           baselines=False, gpu_weights=None, weights="auto", memory=False, kernels=False)
    report = run_profile(args)
    with safe_open(str(DEMO_AR), "pt") as f:
        params = sum(prod(f.get_slice(key).get_shape()) for key in f.keys())
    assert report["shape"] == DEMO_AR.name and report["params"] == params  # the checkpoint, not a random shape
    assert report["grid"] == [16, 16] and set(report["batches"]["1"]["forward_ms"]) == {"1", "4"}
    spec = report["batches"]["1"]["decoders"]["spec"]  # the demo's EAGLE drafter: real acceptance
    assert report["drafter"] == "eagle" and spec["target_forwards"] < 100
    r = subprocess.run([sys.executable, "-m", "fastar", "profile", "--model", str(DEMO_VAR)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode != 0 and "profile times the steps of token models and MAR; demo_var.safetensors is a VAR" \
        in r.stderr


def mar_args(**changes):
    args = dict(shape="mar-tiny", model=None, device="cpu", dtype=None, windows="1", batches=[2], repeats=1,
                no_decoders=False, out=None, compile=False, grid=None, drafter=None, baselines=False, gpu_weights=None,
                weights="auto", memory=False, kernels=False)
    return profile_args(**(args | changes))


def test_a_mar_profile_times_its_transformer_call_head_and_images():
    from torch.utils.flop_counter import FlopCounterMode

    from fastar.commands.profile.mar import build_mar, transformer_gflop

    report = run_profile(mar_args())
    entry = report["batches"]["2"]
    assert report["drafter"].startswith("a MAR of") and report["grid"] == [4, 4]
    assert entry["head_ms"] == entry["head_step_ms"] * 100 and entry["forward_ms"] > 0
    # feature reuse beside it: a reusing call and head step, and the whole step at the default schedule from them
    reuse, steps = entry["reuse"], entry["mar_steps"]
    assert reuse["reused_calls"] == steps - sum(FeatureReuse().full_steps(steps)) > 0
    assert reuse["call_speedup"] == pytest.approx(entry["forward_ms"] / reuse["call_ms"])
    every = FeatureReuse().head_refresh_every
    head = (entry["head_step_ms"] + (every - 1) * reuse["head_step_ms"]) / every * 100
    step = ((steps - reuse["reused_calls"]) * entry["forward_ms"] + reuse["reused_calls"] * reuse["call_ms"]) / steps
    assert reuse["step_speedup"] == pytest.approx((entry["forward_ms"] + entry["head_ms"]) / (step + head))
    assert entry["decoders"]["ar"]["target_forwards"] == 16 and entry["decoders"]["cspd"]["ms_per_iteration"] > 0
    # its arithmetic is what PyTorch counts for the same call (4 rows, half the tokens known); PyTorch's
    # counter leaves attention's products out on the CPU, so they are compared without them
    model = build_mar("mar-tiny", torch.device("cpu"), torch.float32)
    known = torch.zeros(4, 16, dtype=torch.bool)
    known[:, :8] = True
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model.conditions(torch.randn(4, 16, 16), known, model.class_emb(torch.zeros(4, dtype=torch.long)), 8)
    assert transformer_gflop(model, 4, 8, attention=False) * 1e9 == pytest.approx(counter.get_total_flops(), rel=1e-9)
    assert entry["forward_gflop"] == transformer_gflop(model, 4, 8) > transformer_gflop(model, 4, 8, attention=False)


def test_a_compiled_mar_profile_times_its_reverse_process_both_ways():
    report = run_profile(mar_args(compile=True, batches=[1]))
    entry = report["batches"]["1"]
    compiled = entry["compiled_head"]
    assert report["compiled"] == "default" and report["dynamo"]["graph_breaks"] == {}
    assert compiled["speedup"] == pytest.approx(entry["head_process_ms"] / compiled["head_process_ms"])
    assert compiled["apart"] < 1e-2  # the same tokens, to the rounding of fused kernels
    assert set(entry["decoders"]) == {"ar", "cspd", "ar (eager)"} and entry["compiled_forward_ms"] > 0


def test_mar_profiles_refuse_the_token_options():
    with pytest.raises(FastARError, match="--baselines: for token models; a MAR profile times"):
        run_profile(mar_args(baselines=True))
    with pytest.raises(FastARError, match="--kernels: for token models"):
        run_profile(mar_args(kernels=True))


def test_kernels_say_where_a_forward_spends_its_time():
    """--kernels on the CPU: each operator's own time, grouped; a 16-token window spends more of it in matrix
    products than a 1-token one, and the groups add up to the busy time, which the wall time bounds."""
    args = profile_args(shape="tiny", device="cpu", dtype=None, windows="1,16", batches=[2], repeats=2,
                           no_decoders=True, out=None, compile=False, compile_mode=None, model=None, grid=None,
                           drafter=None, baselines=False, gpu_weights=None, weights="auto", memory=False, kernels=True)
    kernels = run_profile(args)["batches"]["2"]["kernels"]
    assert set(kernels) == {"1", "16"}
    for k in kernels.values():
        assert k["busy_ms"] == pytest.approx(sum(k["groups_ms"].values()))
        assert 0 < k["busy_ms"] <= 1.05 * k["wall_ms"] and k["busy_share"] == k["busy_ms"] / k["wall_ms"]
        assert [t["ms"] for t in k["top"]] == sorted((t["ms"] for t in k["top"]), reverse=True)
        assert {"matmul", "attention"} <= set(k["groups_ms"])
        assert next(t for t in k["top"] if t["name"] == "aten::mm")["group"] == "matmul"
    assert kernels["16"]["groups_ms"]["matmul"] > kernels["1"]["groups_ms"]["matmul"]
    assert kernels["1"]["dynamo_host_ms"] == {"guards": 0.0, "inputs": 0.0}  # eager: no dynamo (compiled: test_compiled)


@pytest.mark.parametrize("name, group", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64_warpgroupsize1x1x1_execute_segment_k_off", "matmul"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x1_tn_align8>", "matmul"),
    ("nvjet_sm90_tst_128x8_64x12_4x1_v_bz_TNT", "matmul"), ("triton_tem_fused_mm_3", "matmul"), ("_w8_matmul_kernel", "matmul"),
    ("void pytorch_flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4>>", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"),
    ("Memcpy DtoD (Device -> Device)", "copy"), ("triton_poi_fused_index_put_5", "copy"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1", "elementwise"), ("aten::_index_put_impl_", "copy"),
    ("triton_poi_fused_add_mul_silu_2", "elementwise"), ("aten::mul", "elementwise"),
])
def test_kernel_names_fall_in_their_group(name, group):
    from fastar.commands.profile.kernels import group_of

    assert group_of(name) == group


def test_8_bit_weights_lower_the_floor_and_the_memory_by_their_bytes():
    """--weights int8: the floor reads 1-byte codes (and fp32 scales) where fp32 weights were; the report's memory
    counts the same bytes."""
    args = profile_args(shape="tiny", device="cpu", dtype=None, windows="1", batches=[1], repeats=1,
                           no_decoders=True, out=None, compile=False, compile_mode=None, model=None, grid=None,
                           drafter=None, baselines=False, gpu_weights=None, weights="auto", memory=False, kernels=False)
    full, eight = run_profile(args), run_profile(SimpleNamespace(**{**vars(args), "weights": "int8"}))
    model = build("tiny", torch.device("cpu"), torch.float32)
    blocks = sum(m.weight.numel() for m in model.layers.modules() if isinstance(m, torch.nn.Linear))
    scales = sum(m.weight.shape[0] for m in model.layers.modules() if isinstance(m, torch.nn.Linear))
    saved = 3 * blocks - 4 * scales  # 4 bytes to 1 per weight, plus a 4-byte scale per output channel
    assert eight["weights"] == "int8" and eight["params"] == full["params"]  # 8-bit codes are still parameters
    assert (full["memory"]["weights_gb"] - eight["memory"]["weights_gb"]) * 1e9 == pytest.approx(saved)
    floors = [report["batches"]["1"]["floor_ms"] / (1e3 / report["bandwidth_gb_s"] / 1e9) for report in (full, eight)]
    assert floors[0] - floors[1] == pytest.approx(saved, rel=1e-6)  # bytes, from ms at each run's bandwidth


def test_memory_estimates_any_shape_without_building_it():
    """--memory: a 7B shape's weights and KV cache on no device; int8 blocks fit it with its cache in 12 GB."""
    r = subprocess.run([sys.executable, "-m", "fastar", "profile", "--shape", "lumina-mgpt-7b-768", "--dtype", "bf16",
                        "--memory", "--weights", "int8", "--batches", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    args = profile_args(shape="lumina-mgpt-7b-768", device="cpu", dtype="bf16", batches=[1, 2], out=None,
                           model=None, grid=None, drafter=None, weights="auto", memory=True)
    full, eight = run_profile(args)["memory"], run_profile(SimpleNamespace(**{**vars(args), "weights": "int8"}))["memory"]
    assert 13 < full["weights_gb"] < 14 and 0.5 < eight["weights_gb"] / full["weights_gb"] < 0.55
    assert eight["kv_cache_gb"] == full["kv_cache_gb"] and full["kv_cache_gb"]["2"] == 2 * full["kv_cache_gb"]["1"]
    assert eight["weights_gb"] + eight["kv_cache_gb"]["1"] < 12
    assert "weights 7.09 GB" in r.stdout
