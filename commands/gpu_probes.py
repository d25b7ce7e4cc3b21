"""The GPU check's in-process probes (``python -m fastar.commands.gpu_check --probe NAME``): what a subprocess's
output cannot show, measured inside one process on the GPU."""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from ..model_loaders.shared.demo import DEMO_AR, DEMO_DRAFTER, DEMO_MAR


def probe_sync(device: str, out: Path, images: int = 4, mar_steps: int = 16) -> dict:
    """Host syncs per image of each decoder on the demo models (sync debug mode's warnings, counted): the token
    decoders per target forward, MAR per step (``mar_steps`` of them), CSpD per drafted step, ``images`` at once
    (tests/test_host_syncs.py: the CPU's count)."""
    import torch

    from ..model_loaders import load_ar_model
    from ..model_loaders.drafters.loader import load_drafter
    from ..model_loaders.shared.protocol import ClassConditioning
    from ..samplers.masked_loops.cspd import CSpDSettings
    from ..samplers.decoders import DecoderSpec, decode, decode_masked
    from ..samplers.masked_loops.feature_reuse import FeatureReuse
    from ..samplers.masked_loops.masked import MaskedSettings
    from ..samplers.processing import SamplingSettings

    torch_device = torch.device(device)
    model = load_ar_model(str(DEMO_AR), device=torch_device, dtype=torch.float32)
    spec_drafter = load_drafter(str(DEMO_DRAFTER), model)
    cond = ClassConditioning(torch.arange(images, device=device))
    runs = {name: (lambda seed, name=name: decode(model, cond, SamplingSettings(), DecoderSpec(name), seed=seed,
                                                  **({"drafter": spec_drafter} if name == "spec" else {}))[1])
            for name in ("ar", "sjd", "gsd", "spec", "zipar", "zipar-sjd")}
    mar = load_ar_model(str(DEMO_MAR), device=torch_device, dtype=torch.float32)
    mar_draft = load_drafter("demo", mar)
    masked = MaskedSettings(num_iter=mar_steps, cfg_scale=3.0, diffusion_steps=25)
    runs["mar-ar"] = lambda seed: decode_masked(mar, cond, masked, seed=seed)[1]
    runs["mar-cspd"] = lambda seed: decode_masked(mar, cond, masked, "cspd", seed=seed, drafter=mar_draft,
                                                  cspd=CSpDSettings())[1]
    lazy = replace(masked, reuse=FeatureReuse())
    runs["mar-reuse"] = lambda seed: decode_masked(mar, cond, lazy, seed=seed)[1]
    return {name: counted_syncs(run) for name, run in runs.items()}


def counted_syncs(run) -> dict:
    import warnings

    import torch

    run(0)  # warm-up: tables built, kernels chosen
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            stats = run(1)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "called a synchronizing" in str(w.message)]
    steps = stats.target_forwards + stats.drafter_forwards
    return {"syncs": len(syncs), "target_forwards": stats.target_forwards, "drafter_forwards": stats.drafter_forwards,
            "syncs_per_forward": round(len(syncs) / max(stats.target_forwards, 1), 2),
            "syncs_per_step": round(len(syncs) / max(steps, 1), 2)}


def probe_memory(device: str, out: Path) -> dict:
    """Peak GPU memory of one Anole-7B-shaped ``ar`` image with CFG (random bf16 weights, full 32 x 32 grid)."""
    import torch

    from ..samplers.decoders import DecoderSpec, decode
    from ..samplers.processing import SamplingSettings
    from .profile.speed import build, conditioning

    torch.cuda.reset_peak_memory_stats()
    model = build("anole-7b", torch.device(device), torch.bfloat16)
    weights = torch.cuda.memory_allocated()
    result = {"weights_gb": round(weights / 1e9, 2)}
    for batch in (1, 2):
        torch.cuda.reset_peak_memory_stats()
        t0 = time.time()
        decode(model, conditioning(model, batch), SamplingSettings(cfg_scale=3.0), DecoderSpec("ar"), seed=0)
        torch.cuda.synchronize()
        result[f"batch_{batch}"] = {"peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2),
                                    "over_weights_gb": round((torch.cuda.max_memory_allocated() - weights) / 1e9, 2),
                                    "reserved_gb": round(torch.cuda.max_memory_reserved() / 1e9, 2),
                                    "seconds": round(time.time() - t0, 1)}
    return result


# (out, in) of a 7B block's linears as FastAR runs them: q, k, v joined, and gate, up (joined.py)
BLOCK_LINEARS_7B = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}
# the fused kernel's tiles (BLOCK_M, BLOCK_N, BLOCK_K) the probe times on a block's linears beside block_sizes's
# choice: one M tile for a whole window (64 rows read each weight tile once, 2 x 32 rows twice), narrower N tiles
# (more programs than the GPU has SMs: 4096 outputs in tiles of 32 are 128 programs), wider N, shorter K
TILES = ((16, 16, 256), (16, 32, 256), (16, 32, 128), (16, 64, 128), (32, 64, 128), (64, 64, 128), (64, 32, 128),
         (64, 64, 64))


def probe_w8(device: str, out: Path, shapes: dict = BLOCK_LINEARS_7B, timed=None) -> dict:
    """The fused 8-bit kernel (w8_matmul.py) on this GPU: its products against the fp32 product of the same codes
    (bf16 and fp16, int8 and fp8, a step's rows and a window's), and the 4 linears of a 7B block replayed as a CUDA
    graph, bf16 weights against the kernel and against the dequantised path, at batch 2 with CFG (4 rows for one
    token, 64 for a 16-token window). ``shapes`` and ``timed`` (graph_ms) are the CPU test's to shrink and stub."""
    import torch
    import torch.nn.functional as F

    from ..model_loaders.shared.quantized import QuantizedLinear, dequantize
    from ..model_loaders.shared.kernels.w8_matmul import fused_matmul_applies

    torch.manual_seed(0)
    linears = {name: torch.nn.Linear(i, o, bias=False, device=device, dtype=torch.bfloat16)
               for name, (o, i) in shapes.items()}
    result = {"relative_error": {}, "ms_per_block_linears": {}}
    for fmt in ("int8", "fp8"):
        layer = QuantizedLinear(linears["down"], fmt)
        for dtype in (torch.bfloat16, torch.float16):
            for rows in (1, 4, 64):
                x = torch.randn(rows, layer.in_features, device=device, dtype=dtype)
                want = F.linear(x.float(), dequantize(layer.weight, layer.weight_scale, torch.float32))
                error = ((layer(x).float() - want).abs().max() / want.abs().max()).item()
                result["relative_error"][f"{fmt} {str(dtype)[6:]} rows {rows}"] = float(f"{error:.3g}")
        result[f"{fmt}_fused"] = fused_matmul_applies(x, layer.weight)
    layers = {"bf16": dict(linears)}
    for fmt in ("int8", "fp8"):
        layers[fmt] = {n: QuantizedLinear(lin, fmt) for n, lin in linears.items()}
        layers[f"{fmt} dequantised"] = {n: (lambda x, q=q: F.linear(x, q.weight_for(x)))
                                        for n, q in layers[fmt].items()}
    result["int8_tiles_ms"] = {}  # block_sizes's choice is the one ms_per_block_linears times
    for rows in (4, 64):
        xs = {n: torch.randn(rows, i, device=device, dtype=torch.bfloat16) for n, (o, i) in shapes.items()}
        for name, block in layers.items():
            result["ms_per_block_linears"][f"{name} rows {rows}"] = round(
                (timed or graph_ms)(lambda: [block[n](x) for n, x in xs.items()]), 4)
        if result["int8_fused"]:
            result["int8_tiles_ms"][f"rows {rows}"] = tile_times(layers["int8"], xs, timed or graph_ms)
    return result


def tile_times(block: dict, xs: dict, timed) -> dict:
    """ms of ``block``'s 8-bit linears on inputs ``xs`` with each of TILES that divides their weights."""
    from ..model_loaders.shared.kernels.w8_matmul import fused_matmul, tiles

    times = {}
    for m, n, k in TILES:
        if any(q.out_features % n or q.in_features % k for q in block.values()):
            continue
        blocks = tiles(m, n, k)
        times[f"{m}x{n}x{k}"] = round(timed(lambda: [fused_matmul(x, block[name].weight, block[name].weight_scale,
                                                                  None, blocks) for name, x in xs.items()]), 4)
    return times


def probe_w8_inductor(device: str, out: Path, shapes: dict = BLOCK_LINEARS_7B, timed=None,
                      mode: str = "max-autotune-no-cudagraphs") -> dict:
    """Whether torch.compile fuses the 8-bit product by itself now: gpt-fast's form (the codes cast to bf16 inside
    the matmul, which inductor's autotuned Triton templates can take as a prologue, the scale applied to the output)
    compiled with autotuning, on a 7B block's linears at 4 and 64 rows, beside bf16 compiled the same way and
    FastAR's kernel (w8_matmul.py). If inductor's time is near the kernel's, the kernel is not needed. ``shapes``,
    ``timed`` and ``mode`` are the CPU test's to shrink, stub and keep short."""
    import torch
    import torch.nn.functional as F

    from ..model_loaders.shared.quantized import QuantizedLinear, scaled_product

    def cast_then_scale(x, codes, scale):
        return scaled_product(x, codes.to(x.dtype), scale)

    torch.manual_seed(0)
    linears = {name: torch.nn.Linear(i, o, bias=False, device=device, dtype=torch.bfloat16)
               for name, (o, i) in shapes.items()}
    eight = {name: QuantizedLinear(lin, "int8") for name, lin in linears.items()}
    fused, dense = (torch.compile(f, mode=mode, dynamic=False) for f in (cast_then_scale, F.linear))
    result = {"torch": torch.__version__, "mode": mode, "ms_per_block_linears": {}}
    x = torch.randn(4, linears["down"].in_features, device=device, dtype=torch.bfloat16)
    want = eight["down"](x.float())  # fp32: the dequantised product
    got = fused(x, eight["down"].weight, eight["down"].weight_scale).float()
    result["relative_error"] = float(f"{((got - want).abs().max() / want.abs().max()).item():.3g}")
    for rows in (4, 64):
        xs = {n: torch.randn(rows, i, device=device, dtype=torch.bfloat16) for n, (o, i) in shapes.items()}
        arms = {"inductor int8": lambda: [fused(x, eight[n].weight, eight[n].weight_scale) for n, x in xs.items()],
                "inductor bf16": lambda: [dense(x, linears[n].weight) for n, x in xs.items()],
                "int8 as FastAR runs it": lambda: [eight[n](x) for n, x in xs.items()]}
        for arm, work in arms.items():
            result["ms_per_block_linears"][f"{arm} rows {rows}"] = round((timed or graph_ms)(work), 4)
    return result


# a 7B layer's widths: hidden, q/k/v joined, FFN (Anole-7B's shape)
LAYER_7B = {"dim": 4096, "qkv": 12288, "ffn": 11008}
FUSED_TILES = ((16, 32, 128), (16, 64, 128), (16, 128, 128), (16, 64, 256), (64, 64, 64), (64, 128, 64))


def probe_fused_layer(device: str, out: Path, shape: dict = LAYER_7B, layers: int = 32, dtype: str = "bfloat16",
                      timed=None, compile_mode: str | None = "default") -> dict:
    """A 7B decode step's layers without their attention (RMSNorm, q/k/v, output and its residual, RMSNorm,
    gate/up, SwiGLU, down and its residual; q stands in for the attention's output) at batch 2 with CFG (4 rows for
    one token, 64 for a 16-token window), each replayed as a CUDA graph: as torch runs them compiled by inductor,
    and as fused_matmul.py's four kernels a layer (block_sizes's tiles, then FUSED_TILES): ms per step against the
    floor of reading their weights once at the copy bandwidth, and how far the fused step's output is from torch's.
    ``shape``, ``layers``, ``dtype``, ``timed`` (graph_ms) and ``compile_mode`` (None: eager) are the CPU test's to
    shrink."""
    import torch
    import torch.nn.functional as F

    from ..model_loaders.shared.kernels.fused_matmul import fused_applies, fused_linear
    from ..model_loaders.shared.kernels.w8_matmul import tiles
    from .profile.common import Timing, bandwidth

    dim, qkv, ffn, eps = shape["dim"], shape["qkv"], shape["ffn"], 1e-5
    dtype = getattr(torch, dtype)
    g = torch.Generator(device).manual_seed(0)

    def weight(rows, cols):
        return (torch.randn(rows, cols, device=device, generator=g) * cols ** -0.5).to(dtype)

    def gain():
        return (1 + 0.1 * torch.randn(dim, device=device, generator=g)).to(dtype)

    stack = [{"norm1": gain(), "qkv": weight(qkv, dim), "o": weight(dim, dim), "norm2": gain(),
              "w13": weight(2 * ffn, dim), "down": weight(dim, ffn)} for _ in range(layers)]

    def rms(x, gain):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * gain

    def torch_layers(h):
        for w in stack:
            attention = F.linear(rms(h, w["norm1"]), w["qkv"])[:, :dim].contiguous()
            h = h + F.linear(attention, w["o"])
            gate, up = F.linear(rms(h, w["norm2"]), w["w13"]).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, w["down"])
        return h

    def fused_layers(h, blocks=None):
        for w in stack:
            attention = fused_linear(h, w["qkv"], norm=(w["norm1"], eps), blocks=blocks)[:, :dim].contiguous()
            h = fused_linear(attention, w["o"], residual=h, blocks=blocks)
            ffn_out = fused_linear(h, w["w13"], norm=(w["norm2"], eps), swiglu=True, blocks=blocks)
            h = fused_linear(ffn_out, w["down"], residual=h, blocks=blocks)
        return h

    weight_bytes = sum(t.numel() * t.element_size() for w in stack for t in w.values())
    compiled = torch.compile(torch_layers, mode=compile_mode, dynamic=False) if compile_mode else torch_layers
    result = {"layers": layers, "shape": shape, "weights_gb": round(weight_bytes / 1e9, 3), "ms_per_step": {},
              "relative_difference": {}, "fused_tiles_ms": {}}
    if timed is None:
        result["floor_ms"] = round(weight_bytes / bandwidth(Timing(torch.device(device), 5)) * 1e3, 4)
    for rows in (4, 64):
        h = torch.randn(rows, dim, device=device, generator=g).to(dtype)
        if not all(fused_applies(h, w, swiglu) for w, swiglu in ((stack[0]["qkv"], False),
                                                                (stack[0]["w13"], True), (stack[0]["down"], False))):
            result["fused_tiles_ms"][f"rows {rows}"] = "the tiles do not divide this shape"
            continue
        want, got = compiled(h).float(), fused_layers(h).float()
        result["relative_difference"][f"rows {rows}"] = float(
            f"{((got - want).abs().max() / want.abs().max()).item():.3g}")
        for name, work in (("torch compiled", lambda: compiled(h)), ("fused", lambda: fused_layers(h))):
            result["ms_per_step"][f"{name} rows {rows}"] = round((timed or graph_ms)(work), 4)
        result["fused_tiles_ms"][f"rows {rows}"] = {
            "x".join(map(str, t)): round((timed or graph_ms)(lambda t=t: fused_layers(h, tiles(*t))), 4)
            for t in FUSED_TILES if all(dim % t[2] == 0 and ffn % t[2] == 0 and n % t[1] == 0
                                        for n in (qkv, dim, ffn))}
    return result


def graph_ms(work, replays: int = 50) -> float:
    """Milliseconds per replay of ``work`` captured as a CUDA graph (launch overhead out of the timing)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up off the capture stream: Triton compiles, cuBLAS picks its kernels
            work()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        work()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


PROBES = {"sync": probe_sync, "memory": probe_memory, "w8": probe_w8, "w8-inductor": probe_w8_inductor,
          "fused-layer": probe_fused_layer}
