"""``python -m fastar profile``: how close a target forward and a decoder iteration come to the
memory-bandwidth floor (bench.md), on a random-weight model of a real shape (no checkpoint needed) or on a
checkpoint (``--model``).

    python -m fastar profile --shape llamagen-xl [--device cuda] [--dtype bf16] [--out profile.json]
    python -m fastar profile --model demo/demo_c2i.safetensors --compile

- Bandwidth: a copy benchmark on the device (bytes read + written per second, median of repeats).
- Forward: ms per target forward of a window of W tokens (``--windows``, default 1..64) with the KV cache half
  full, at batch 1 and 2 (with CFG: 2 and 4 rows); c(W) = ms(W) / ms(1).
- Floor of one forward: the bytes it must read (every weight but the input embedding table, which a forward
  touches only W rows of, and the filled part of the KV cache) over the measured bandwidth; the ratio to it.
- Decoder iterations: ms per target forward of whole images with ``ar``, ``sjd`` and ``gsd`` (wall time over
  target forwards, sampling and verification included), and their ratio to the floor.
- ``--compile``: the steps through torch.compile (model_loaders/compiled.py), and the same measurements on an
  eager twin with the same weights, side by side in the report (``eager``).
Times are medians of interleaved repeats after a warm-up; CUDA is synchronised around each.
"""
from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import FastARError
from ..model_loaders.chameleon_model import ChameleonConfig, ChameleonGPT
from ..model_loaders.compiled import compile_steps
from ..model_loaders.llamagen_gpt import LlamaGenConfig, LlamaGenGPT
from ..model_loaders.protocol import ClassConditioning, PromptConditioning
from ..samplers.decoders import DecoderSpec, decode
from ..samplers.processing import SamplingSettings

DECODERS = ("ar", "sjd", "gsd")
PROMPT_TOKENS = 32  # a typical prompt's length for the text-to-image shapes


def llamagen(dim: int, n_layer: int, n_head: int, grid=(16, 16)):
    return lambda: LlamaGenGPT(LlamaGenConfig(dim=dim, n_layer=n_layer, n_head=n_head, vocab_size=16384, grid=grid))


def chameleon_7b(grid: tuple[int, int], row_end: bool):
    """Lumina-mGPT / Anole 7B: Chameleon-7B's decoder, 8192 image codes in a 65536-token vocabulary."""
    cfg = ChameleonConfig(hidden_size=4096, n_layer=32, n_head=32, n_kv_head=32, ffn_hidden=11008, vocab_size=65536,
                          image_ids=list(range(4, 8196)), boi=8197, eoi=8196, grid=grid,
                          row_end=8803 if row_end else None, size_ids=[8800 + grid[0] // 2, 8800 + grid[1] // 2])
    return lambda: ChameleonGPT(cfg, prompts=FixedPrompts(), what="a Chameleon-7B-shaped model")


SHAPES = {
    "tiny": llamagen(64, 2, 4, grid=(8, 8)),  # for a quick smoke run
    "demo": llamagen(256, 4, 8),
    "llamagen-b": llamagen(768, 12, 12),
    "llamagen-l": llamagen(1024, 24, 16),
    "llamagen-xl": llamagen(1280, 36, 20),
    "llamagen-xxl": llamagen(1536, 48, 24),
    "lumina-mgpt-7b-768": chameleon_7b((48, 48), row_end=True),
    "anole-7b": chameleon_7b((32, 32), row_end=False),
}


class FixedPrompts:
    """Stands in for a tokenizer: every prompt is the same ``PROMPT_TOKENS`` ids (the length is what costs)."""

    def encode(self, conditioning: PromptConditioning) -> list[list[int]]:
        return [[1] + list(range(20000, 20000 + PROMPT_TOKENS - 1))] * conditioning.batch


@dataclass
class Timing:
    device: torch.device
    repeats: int

    def median_s(self, fn) -> float:
        fn()  # warm-up
        samples = []
        for _ in range(self.repeats):
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def build(shape: str, device: torch.device, dtype: torch.dtype):
    if shape not in SHAPES:
        raise FastARError(f"--shape {shape}: choose one of {', '.join(SHAPES)}")
    torch.manual_seed(0)
    with torch.device(device):
        model = SHAPES[shape]()
    with torch.no_grad():  # small random weights keep activations finite in fp16
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.02)
    return model.to(dtype).eval()


def conditioning(model, batch: int):
    if getattr(model, "conditioning_kind", "class") == "prompt":
        return PromptConditioning(["a photo"] * batch)
    return ClassConditioning(torch.zeros(batch, dtype=torch.long))


def bandwidth(timing: Timing, megabytes: int = 256) -> float:
    """Bytes per second a device copy reads and writes."""
    source = torch.empty(megabytes << 20, dtype=torch.uint8, device=timing.device)
    target = torch.empty_like(source)
    return 2 * source.numel() / timing.median_s(lambda: target.copy_(source))


def weight_bytes_read(model) -> int:
    """Every weight a forward reads: all but the input embedding table (only the fed rows are gathered)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in embeddings)


def kv_bytes_read(model, rows: int, filled: int) -> int:
    cfg = getattr(model, "decoder_cfg", None) or model.cfg
    element = torch.finfo(model.dtype).bits // 8
    return rows * cfg.n_layer * 2 * cfg.n_kv_head * cfg.head_dim * filled * element


@torch.no_grad()
def forward_costs(model, timing: Timing, batch: int, windows: list[int]) -> dict:
    """ms per forward of each window at mid-image, with CFG (2 rows per image)."""
    N = model.grid[0] * model.grid[1]
    session = model.start(conditioning(model, batch), cfg=True, max_window=max(windows))
    start = torch.full((batch,), N // 2, dtype=torch.long, device=model.device)
    return {w: timing.median_s(lambda w=w: session.forward(torch.zeros(batch, w, dtype=torch.long,
                                                                       device=model.device), start)) * 1e3
            for w in windows}


@torch.no_grad()
def iteration_costs(model, batch: int) -> dict:
    """ms per target forward of whole images (decoder overheads included), one run each after a warm-up."""
    sampling = SamplingSettings(cfg_scale=3.0)
    costs = {}
    for name in DECODERS:
        decode(model, conditioning(model, batch), sampling, DecoderSpec(name), seed=0)
        _, stats = decode(model, conditioning(model, batch), sampling, DecoderSpec(name), seed=1)
        costs[name] = {"ms_per_iteration": stats.wall_time_s / stats.target_forwards * 1e3,
                       "target_forwards": stats.target_forwards, "image_s": stats.wall_time_s}
    return costs


def load(path: str, device: torch.device, dtype: torch.dtype):
    """A checkpoint (``--model``) instead of a random shape: its own weights, so acceptance is real."""
    from ..model_loaders import load_ar_model

    model = load_ar_model(path, device=device, dtype=dtype)
    if getattr(model, "kind", "token-ar") != "token-ar":
        raise FastARError(f"profile times token models' steps; {Path(path).name} is {model.what}")
    return model.eval()


def run_profile(args) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    windows = sorted({int(w) for w in args.windows.split(",")} | {1})
    timing = Timing(device, args.repeats)
    make = (lambda: load(args.model, device, dtype)) if getattr(args, "model", None) else \
        (lambda: build(args.shape, device, dtype))
    model = make()
    eager_twin = make() if args.compile else None  # the same weights, timed beside the compiled steps
    if args.compile:
        compile_steps(model)
    bytes_per_s = bandwidth(timing)
    N = model.grid[0] * model.grid[1]
    prefix = PROMPT_TOKENS + 3 if getattr(model, "conditioning_kind", "") == "prompt" else 1
    name = Path(args.model).name if getattr(args, "model", None) else args.shape
    report = {"shape": name, "device": str(device), "dtype": args.dtype, "machine": platform.machine(),
              "compiled": getattr(model, "compiled_mode", None),
              "params": sum(p.numel() for p in model.parameters()), "grid": list(model.grid),
              "bandwidth_gb_s": bytes_per_s / 1e9, "batches": {}}
    print(f"[profile] {name}: {report['params'] / 1e6:.1f}M parameters on {device} ({args.dtype}"
          + (f", compiled: {report['compiled']}" if report["compiled"] else "") + "), "
          f"copy bandwidth {bytes_per_s / 1e9:.1f} GB/s", flush=True)
    for batch in args.batches:
        rows = 2 * batch  # CFG
        floor_ms = (weight_bytes_read(model) + kv_bytes_read(model, rows, prefix + N // 2)) / bytes_per_s * 1e3
        forward = forward_costs(model, timing, batch, windows)
        entry = {"floor_ms": floor_ms,
                 "forward_ms": {str(w): ms for w, ms in forward.items()},
                 "window_cost": {str(w): ms / forward[1] for w, ms in forward.items()},
                 "forward_over_floor": forward[1] / floor_ms}
        if not args.no_decoders:
            iterations = iteration_costs(model, batch)
            for cost in iterations.values():
                cost["over_floor"] = cost["ms_per_iteration"] / floor_ms
            entry["decoders"] = iterations
        if eager_twin is not None:
            entry["eager"] = {"forward_ms": {str(w): ms for w, ms in forward_costs(eager_twin, timing, batch,
                                                                                  windows).items()}}
            if not args.no_decoders:
                entry["eager"]["decoders"] = iteration_costs(eager_twin, batch)
        report["batches"][str(batch)] = entry
        print(f"[profile] batch {batch} (CFG, {rows} rows): floor {floor_ms:.2f} ms, 1-token forward "
              f"{forward[1]:.2f} ms ({entry['forward_over_floor']:.2f}x floor); c(W): "
              + ", ".join(f"{w}: {c:.2f}" for w, c in entry["window_cost"].items()), flush=True)
        for decoder, cost in entry.get("decoders", {}).items():
            print(f"[profile]   {decoder}: {cost['ms_per_iteration']:.2f} ms per iteration "
                  f"({cost['over_floor']:.2f}x floor), {cost['target_forwards']} iterations per image, "
                  f"{cost['image_s']:.3f} s per image", flush=True)
        if "eager" in entry:
            eager = entry["eager"]
            print("[profile]   eager (the same weights): 1-token forward "
                  f"{eager['forward_ms']['1']:.2f} ms; " + ", ".join(
                      f"{decoder} {cost['image_s']:.3f} s per image" for decoder, cost in eager.get("decoders", {}).items()),
                  flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"[profile] wrote {args.out}")
    return report
