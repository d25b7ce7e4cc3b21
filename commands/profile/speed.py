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
- Decoder iterations: ms per target forward of whole images with ``ar``, ``sjd``, ``gsd`` and ``spec``, or those
  ``--decoders`` names (PROFILED: ``sjd-pac``, ``zipar`` and ``spec`` on trees too) (wall time over target
  forwards, sampling, verification and drafting included), and their ratio to the floor. A
  random shape's ``spec`` drafts with a random 2-layer model of the same shape (its acceptance means nothing,
  its cost does); a checkpoint's takes ``--drafter``.
- ``--compile``: the steps through torch.compile (model_loaders/shared/compiled.py), and the same measurements on an
  eager twin with the same weights, side by side in the report (``eager``); the compiled forwards and ``sjd`` images
  again with every call guarded in full (``full_guards_forward_ms``, ``full_guards_decoders``: what a repeated call
  saves by skipping most of dynamo's guards), and ``sjd`` images with each iteration's sampling, verification and
  drafts eager (``eager_loop_step_decoders``: what compiling them saves, samplers/token_loops/loop_step.py); the graphs dynamo
  compiled and any graph break (``dynamo``). ``--no-eager-twin`` leaves the twin out.
- ``--gpu-weights GB``: the model with only that much of its weights on the GPU, its other blocks streamed from
  pinned host memory at every forward (model_loaders/shared/streaming.py); the floor then counts the streamed bytes at
  the measured host-to-device bandwidth.
- ``--baselines``: the family's usual loops on the same weights (loop_baselines.py beside this file), each as a
  multiple of ``ar``, and one table of them beside every decoder (side_by_side.py).
- MAR shapes and checkpoints: a transformer call, the diffusion head and whole ``ar`` / ``cspd`` images
  (mar.py beside this file).
Times are medians of interleaved repeats after a warm-up (whole images: A B C A B C ..., at most 5 rounds);
CUDA is synchronised around each.
"""
from __future__ import annotations

import json
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from ...errors import FastARError
from ...model_loaders.drafters.small_ar import SmallARDrafter
from ...model_loaders.chameleon.model import ChameleonConfig, ChameleonGPT
from ...model_loaders.shared.compiled import compile_steps, compiled_mode, graph_breaks, guards_in_full, unique_graphs
from ...model_loaders.drafters.loader import load_drafter
from ...model_loaders.janus.model import JanusConfig, JanusGPT
from ...model_loaders.llamagen.model import LlamaGenConfig, LlamaGenGPT
from ...model_loaders.shared.llm_decoder import DecoderConfig
from ...model_loaders.shared.protocol import ClassConditioning, PromptConditioning
from ...model_loaders.shared.quantized import QuantizedLinear, quantize_weights
from ...model_loaders.shared.streaming import make_streamable, model_bytes, place, streamed_bytes
from ...memory import kv_cache_bytes
from ...pipeline import DTYPES, check_gpu_weights, resolve_device
from ...samplers.decoders import LOSSLESS, DecoderSpec, decode
from ...samplers.token_loops.loop_step import eager_loop_steps
from ...samplers.processing import SamplingSettings
from .loop_baselines import baseline_loops
from .side_by_side import side_by_side
from .var import VAR_SHAPES, run_var_profile
from .mar import MAR_SHAPES, build_mar, check_mar_options, mar_batch, print_mar_batch, random_draft
from .common import Timing, bandwidth, host_bandwidth, image_costs, randomise
from .kernels import kernel_breakdown, print_breakdown

# the decoders ``--decoders`` may name, each at its defaults; ``spec`` and its trees draft with the drafter
PROFILED = {"ar": DecoderSpec("ar"), "sjd": DecoderSpec("sjd"), "sjd-pac": DecoderSpec("sjd-pac"),
            "gsd": DecoderSpec("gsd"), "zipar": DecoderSpec("zipar"), "spec": DecoderSpec("spec"),
            "spec-static": DecoderSpec("spec", tree="static"), "spec-dynamic": DecoderSpec("spec", tree="dynamic")}
DEFAULT_DECODERS = ("ar", "sjd", "gsd", "spec")
PROMPT_TOKENS = 32  # a typical prompt's length for the text-to-image shapes
DRAFTER_LAYERS = 2  # a random shape's drafter for ``spec``: the target's shape with this many layers


class FixedPrompts:
    """Stands in for a tokenizer: every prompt is the same ``PROMPT_TOKENS`` ids (the length is what costs),
    ending with ``boi`` where the model's prompts carry it (Janus)."""

    def __init__(self, bos: int = 1, boi: int | None = None, filler: int = 20000):
        body = PROMPT_TOKENS - 1 - (boi is not None)
        self.ids = [bos] + list(range(filler, filler + body)) + ([boi] if boi is not None else [])

    def encode(self, conditioning: PromptConditioning) -> list[list[int]]:
        return [list(self.ids)] * conditioning.batch


@dataclass(frozen=True)
class Shape:
    """A released model's shape: its transformer (width, layers, heads, MLP width) and image grid."""

    family: str  # llamagen, chameleon or janus
    width: int
    layers: int
    heads: int
    grid: tuple[int, int]
    ffn: int | None = None  # LlamaGen derives it from the width
    row_end: bool = False  # Lumina-mGPT's row-end tokens

    def build(self, layers: int | None = None, grid: tuple[int, int] | None = None):
        layers, grid = layers or self.layers, grid or self.grid
        if self.family == "llamagen":
            return LlamaGenGPT(LlamaGenConfig(dim=self.width, n_layer=layers, n_head=self.heads, vocab_size=16384,
                                              grid=grid))
        if self.family == "chameleon":  # Chameleon-7B's decoder: 8192 image codes in a 65536-token vocabulary;
            # Lumina-mGPT's layout (size tokens after boi, row ends, CFG rows from boi) or Anole's (CFG rows bos, boi)
            lumina = self.row_end
            cfg = ChameleonConfig(hidden_size=self.width, n_layer=layers, n_head=self.heads, n_kv_head=self.heads,
                                  ffn_hidden=self.ffn, vocab_size=65536, image_ids=list(range(4, 8196)), boi=8197,
                                  eoi=8196, grid=grid, row_end=8803 if lumina else None,
                                  size_ids=[8800 + grid[0] // 2, 8800 + grid[1] // 2] if lumina else [],
                                  uncond_bos=not lumina)
            model = ChameleonGPT(cfg, prompts=FixedPrompts(bos=cfg.bos), what="a Chameleon-7B-shaped model")
            model.keep_image_rows()  # as the loader leaves it
            return model
        # Janus-Pro: a DeepSeek-LLM decoder (102400 tokens) with the 16384-code generation path at its width
        decoder = DecoderConfig(hidden_size=self.width, n_layer=layers, n_head=self.heads, n_kv_head=self.heads,
                                ffn_hidden=self.ffn, vocab_size=102400, rms_eps=1e-6)
        cfg = JanusConfig(decoder=decoder, codes=16384, code_width=8, aligner_layers=2, head_width=self.width,
                          grid=grid, pad=100015, bos=100000, boi=100016)
        return JanusGPT(cfg, prompts=FixedPrompts(bos=cfg.bos, boi=cfg.boi), what="a Janus-Pro-shaped model")


SHAPES = {
    "tiny": Shape("llamagen", 64, 2, 4, (8, 8)),  # for a quick smoke run
    "demo": Shape("llamagen", 256, 4, 8, (16, 16)),
    "llamagen-b": Shape("llamagen", 768, 12, 12, (16, 16)),
    "llamagen-l": Shape("llamagen", 1024, 24, 16, (16, 16)),
    "llamagen-xl": Shape("llamagen", 1280, 36, 20, (16, 16)),
    "llamagen-xxl": Shape("llamagen", 1536, 48, 24, (16, 16)),
    "lumina-mgpt-7b-768": Shape("chameleon", 4096, 32, 32, (48, 48), ffn=11008, row_end=True),
    "anole-7b": Shape("chameleon", 4096, 32, 32, (32, 32), ffn=11008),
    "lumina-tiny": Shape("chameleon", 64, 2, 4, (4, 4), ffn=96, row_end=True),  # smoke runs: row-end layout
    "anole-tiny": Shape("chameleon", 64, 2, 4, (4, 4), ffn=96),  # smoke runs: Anole's layout
    "janus-tiny": Shape("janus", 64, 2, 4, (6, 6), ffn=96),  # for a quick smoke run
    "janus-pro-1b": Shape("janus", 2048, 24, 16, (24, 24), ffn=5632),
    "janus-pro-7b": Shape("janus", 4096, 30, 32, (24, 24), ffn=11008),
}


def build(shape: str, device: torch.device, dtype: torch.dtype, *, layers: int | None = None,
          grid: tuple[int, int] | None = None, seed: int = 0):
    """A random-weight model of ``shape`` (``layers``, ``grid``: overrides)."""
    if shape not in SHAPES:
        raise FastARError(f"--shape {shape}: choose one of {', '.join([*SHAPES, *MAR_SHAPES, *VAR_SHAPES])}")
    with torch.device(device):
        model = SHAPES[shape].build(layers, grid)
    randomise(model, seed)
    return model.to(dtype).eval()


def conditioning(model, batch: int):
    if getattr(model, "conditioning_kind", "class") == "prompt":
        return PromptConditioning(["a photo"] * batch)
    return ClassConditioning(torch.zeros(batch, dtype=torch.long))


def weight_bytes_read(model) -> int:
    """Every weight a forward reads: all but the input embedding table (only the fed rows are gathered); an
    8-bit layer's codes and scales."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    eight_bit = [t for m in model.modules() if isinstance(m, QuantizedLinear) for t in m.buffers()]
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *eight_bit] if id(t) not in embeddings)


def parameter_count(model) -> int:
    """The model's parameters, an 8-bit layer's weight codes included (they are buffers, not parameters)."""
    codes = sum(m.weight.numel() for m in model.modules() if isinstance(m, QuantizedLinear))
    return sum(p.numel() for p in model.parameters()) + codes


def kv_bytes_read(model, rows: int, filled: int) -> int:
    cfg = getattr(model, "decoder_cfg", None) or model.cfg
    element = torch.finfo(model.dtype).bits // 8
    return rows * cfg.n_layer * 2 * cfg.n_kv_head * cfg.head_dim * filled * element


def mid_image_forwards(model, batch: int, windows: list[int], whole_cache: bool = False) -> dict:
    """A forward of each window at mid-image, with CFG (2 rows per image), in one session, attending over the
    slots a decoder's would (``key_slots``), or over the whole cache (a bound past every slot: the same compiled
    graph): ``window -> step()``."""
    N = model.grid[0] * model.grid[1]
    session = model.start(conditioning(model, batch), cfg=True, max_window=max(windows))
    start = torch.full((batch,), N // 2, dtype=torch.long, device=model.device)
    return {w: lambda w=w: session.forward(torch.zeros(batch, w, dtype=torch.long, device=model.device), start,
                                           session.key_slots(session.total_slots if whole_cache else N // 2 + w))
            for w in windows}


@torch.no_grad()
def forward_costs(model, timing: Timing, batch: int, windows: list[int], whole_cache: bool = False) -> dict:
    """ms per forward of each window at mid-image (``mid_image_forwards``)."""
    steps = mid_image_forwards(model, batch, windows, whole_cache)
    return {w: timing.median_s(step) * 1e3 for w, step in steps.items()}


@torch.no_grad()
def forward_kernels(model, batch: int, windows: list[int]) -> dict:
    """``--kernels``: where the time of a 1-token and of the widest window's forward goes (kernels.py)."""
    steps = mid_image_forwards(model, batch, windows)
    return {str(w): kernel_breakdown(steps[w], model.device) for w in sorted({1, max(windows)})}


@torch.no_grad()
def logit_gaps(model, twin, batch: int, windows: list[int]) -> dict:
    """The largest |logit difference| between ``model`` and ``twin`` (same weights: compiled and eager) for the
    same window at mid-image, cond and uncond rows."""
    N = model.grid[0] * model.grid[1]
    start = torch.full((batch,), N // 2, dtype=torch.long, device=model.device)
    tokens = {w: torch.randint(0, model.vocab_size, (batch, w), generator=torch.Generator().manual_seed(w)
                               ).to(model.device) for w in windows}
    sessions = [each.start(conditioning(each, batch), cfg=True, max_window=max(windows)) for each in (model, twin)]
    ours, theirs = ({w: session.forward(tokens[w], start, session.key_slots(N // 2 + w)) for w in windows}
                    for session in sessions)
    return {str(w): max((ours[w].cond - theirs[w].cond).abs().max().item(),
                        (ours[w].uncond - theirs[w].uncond).abs().max().item()) for w in windows}


# sjd's compiled variants, each timed beside the default: every compiled call checking every guard (repeats
# included), and each iteration's sampling, verification and drafts run eagerly
SJD_VARIANTS = {"sjd, guards in full": ("full_guards_decoders", guards_in_full),
                "sjd, eager loop steps": ("eager_loop_step_decoders", eager_loop_steps)}


def under(context, run):
    def image(seed):
        with context():
            return run(seed)
    return image


def parse_decoders(text: str) -> tuple[str, ...]:
    """``--decoders``: comma-separated names of PROFILED, or ``all``; ``ar`` always (what the others compare with)."""
    names = tuple(PROFILED) if text == "all" else tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in PROFILED]
    if unknown:
        raise FastARError(f"{', '.join(unknown)} unknown; choose from {', '.join(PROFILED)} or all")
    return ("ar", *(n for n in names if n != "ar"))


def decoder_runs(model, drafter, batch: int, sampling: SamplingSettings, names=DEFAULT_DECODERS) -> dict:
    """The decoders ``names`` at their defaults (those that draft only with a drafter), as
    ``seed -> (forwards, codes)``."""
    def run(spec):
        def image(seed):
            codes, stats = decode(model, conditioning(model, batch), sampling, spec, seed=seed,
                                  drafter=drafter if spec.decoder == "spec" else None)
            return stats.target_forwards, codes
        return image
    return {name: run(PROFILED[name]) for name in names if PROFILED[name].decoder != "spec" or drafter is not None}


def baseline_runs(args, model, batch: int, sampling: SamplingSettings) -> dict:
    """The family's usual loops (loop_baselines.py beside this file) on the same weights, as
    ``seed -> (forwards, codes)``."""
    tokens = model.grid[0] * model.grid[1]

    def run(loop):
        def image(seed):
            return tokens, loop(conditioning(model, batch), sampling, torch.Generator(model.device).manual_seed(seed))
        return image
    loops = baseline_loops(model, llamagen_code=args.llamagen_code, compiled=args.compile)
    return {name: run(loop) for name, loop in loops.items()}


def load(path: str, device: torch.device, dtype: torch.dtype, weights: str = "auto"):
    """A checkpoint (``--model``) instead of a random shape: its own weights, so acceptance is real."""
    from ...model_loaders import load_ar_model

    model = load_ar_model(path, weights, device=device, dtype=dtype)
    if getattr(model, "kind", "token-ar") not in ("token-ar", "masked-ar"):
        raise FastARError(f"profile times the steps of token models and MAR; {Path(path).name} is {model.what}")
    return model.eval()


def target(args, device: torch.device, dtype: torch.dtype):
    """The model profiled: a random shape, or ``--model``; its blocks in ``--weights``."""
    if args.model:
        if args.grid:
            raise FastARError("--grid resizes a random shape; a checkpoint keeps its own grid")
        return load(args.model, device, dtype, args.weights)
    return quantize_weights(random_target(args, device, dtype), args.weights)


def random_target(args, device: torch.device, dtype: torch.dtype):
    if args.drafter:
        raise FastARError("--drafter goes with --model; a random shape drafts with a random smaller model of its "
                          f"shape ({DRAFTER_LAYERS} layers; MAR-L and MAR-H: MAR-B)")
    if args.shape in MAR_SHAPES:
        return build_mar(args.shape, device, dtype)
    return build(args.shape, device, dtype, grid=parse_grid(args.grid) if args.grid else None)


def stream(args, model, device: torch.device) -> None:
    """Keep ``--gpu-weights`` GB of ``model`` (built in host memory) on ``device``, stream the rest."""
    if model.kind == "masked-ar":
        raise FastARError("--gpu-weights: profile streams token models' weights; MAR models fit a GPU whole")
    if args.compile:
        raise FastARError("--gpu-weights and --compile: compiled steps are off while weights stream; drop one")
    place(make_streamable(model), device, int(args.gpu_weights * 1e9))


def drafter_for(args, model):
    """The drafter of the ``spec`` / ``cspd`` runs: ``--drafter`` for a checkpoint (None: those runs are left
    out), a random smaller model of the shape for a random shape."""
    if args.model:
        return load_drafter(args.drafter, model, weights=args.weights) if args.drafter else None
    if args.shape in MAR_SHAPES:
        return quantize_weights(random_draft(args.shape, model.device, model.dtype), args.weights)
    small = build(args.shape, model.device, model.dtype, layers=DRAFTER_LAYERS, grid=model.grid, seed=1)
    return SmallARDrafter(quantize_weights(small, args.weights))


def drafter_name(drafter) -> str | None:
    if drafter is None or hasattr(drafter, "name"):
        return getattr(drafter, "name", None)
    return f"a MAR of {sum(p.numel() for p in drafter.parameters()) / 1e6:.0f}M parameters"


def parse_grid(text: str) -> tuple[int, int]:
    try:
        rows, cols = (int(n) for n in text.lower().split("x"))
    except ValueError:
        raise FastARError(f"--grid {text}: give rows x columns of image tokens, e.g. 8x8") from None
    if rows < 2 or cols < 2:
        raise FastARError(f"--grid {text}: give at least 2 x 2 image tokens")
    return rows, cols


def memory_needs(model, batches: list[int]) -> dict:
    """What a generation holds in device memory: the weights (in their format) and, at each batch, the static KV
    cache of CFG's rows over the conditioning and the image with a Jacobi window (memory.py's estimate; MAR's
    bidirectional steps keep none)."""
    window = DecoderSpec("sjd").window
    mar = model.kind == "masked-ar"
    return {"weights_gb": model_bytes(model) / 1e9,
            "kv_cache_gb": {str(b): 0.0 if mar else kv_cache_bytes(model, conditioning(model, 1), b, True, window) / 1e9
                            for b in batches}}


MEMORY_DTYPE = "bf16"  # --memory's default: what a GPU computes in (README's table), whatever machine estimates it


def run_memory(args) -> dict:
    """``--memory``: the estimate alone, the model built on no device (any size, on any machine)."""
    if args.model:
        raise FastARError("--memory estimates a shape (--shape); a checkpoint's profile reports its memory")
    dtype = args.dtype or MEMORY_DTYPE
    said = dtype if args.dtype else f"{dtype}, as a GPU runs it: --dtype for another"
    needs = memory_needs(target(args, torch.device("meta"), DTYPES[dtype]), args.batches)
    caches = needs["kv_cache_gb"]
    cache = ("KV cache with CFG " + ", ".join(f"batch {b}: {gb:.2f} GB" for b, gb in caches.items())
             + "; total " + ", ".join(f"batch {b}: {needs['weights_gb'] + gb:.2f} GB" for b, gb in caches.items())
             if any(caches.values()) else "no KV cache (MAR's steps are bidirectional)")
    print(f"[profile] {args.shape} ({said}; weights {args.weights}): weights {needs['weights_gb']:.2f} GB; "
          f"{cache}", flush=True)
    return {"shape": args.shape, "dtype": dtype, "weights": args.weights, "memory": needs}


def run_profile(args) -> dict:
    if args.shape in VAR_SHAPES:  # scales, not windows: its own report
        return write_report(run_var_profile(args), args.out)
    if args.memory:
        return write_report(run_memory(args), args.out)
    if args.llamagen_code and not args.baselines:
        raise FastARError("--llamagen-code goes with --baselines (the loops timed beside FastAR's)")
    device = resolve_device(args.device or "auto")
    args.dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    dtype = DTYPES[args.dtype]
    timing = Timing(device, args.repeats)
    check_gpu_weights(args.gpu_weights, device)
    model = target(args, device if args.gpu_weights is None else torch.device("cpu"), dtype)
    mar = model.kind == "masked-ar"
    if args.gpu_weights is not None:
        stream(args, model, device)
    drafter = drafter_for(args, model)
    if mar:
        check_mar_options(args)
    twin = args.compile and not mar and not args.no_eager_twin
    eager_twin = target(args, device, dtype) if twin else None  # the same weights, beside it
    if args.compile:
        compile_steps(model, mode=getattr(args, "compile_mode", None))
    bytes_per_s = bandwidth(timing)
    host_bytes_per_s = host_bandwidth(timing) if streamed_bytes(model) else None
    name = Path(args.model).name if args.model else args.shape
    report = {"shape": name, "random_weights": not args.model, "device": str(device), "dtype": args.dtype,
              "weights": args.weights,
              "machine": platform.machine(), "compiled": compiled_mode(model),
              "params": parameter_count(model), "grid": list(model.grid),
              "drafter": drafter_name(drafter),
              "bandwidth_gb_s": bytes_per_s / 1e9, "memory": memory_needs(model, args.batches),
              "batches": {}}
    if host_bytes_per_s:
        report |= {"streamed_gb": streamed_bytes(model) / 1e9, "host_bandwidth_gb_s": host_bytes_per_s / 1e9}
    print(f"[profile] {name}: {report['params'] / 1e6:.1f}M parameters on {device} ({args.dtype}"
          + (f", {args.weights} blocks" if args.weights != "auto" else "")
          + (f", compiled: {report['compiled']}" if report["compiled"] else "") + "), "
          f"copy bandwidth {bytes_per_s / 1e9:.1f} GB/s"
          + (f"; {report['streamed_gb']:.2f} GB of weights streamed from host memory at "
             f"{report['host_bandwidth_gb_s']:.1f} GB/s" if host_bytes_per_s else ""), flush=True)
    rounds = min(args.repeats, 5)
    graphs, breaks = unique_graphs(), graph_breaks()
    for batch in args.batches:
        if mar:
            entry = mar_batch(model, drafter, timing, batch, bytes_per_s, not args.no_decoders, rounds)
            print_mar_batch(batch, entry)
        else:
            entry = token_batch(args, model, drafter, eager_twin, timing, batch, bytes_per_s, rounds,
                                host_bytes_per_s)
            print_batch(batch, entry)
        report["batches"][str(batch)] = entry
    if report["compiled"]:
        report["dynamo"] = dynamo_since(graphs, breaks)
        print(f"[profile] dynamo compiled {report['dynamo']['graphs']} graphs for this profile's steps, with "
              f"{sum(report['dynamo']['graph_breaks'].values())} graph breaks"
              + "".join(f"\n[profile]   break: {reason[:150]}" for reason in report["dynamo"]["graph_breaks"]),
              flush=True)
    return write_report(report, args.out)


def dynamo_since(graphs: int, breaks: dict) -> dict:
    """The graphs dynamo compiled and the graph breaks it met (by reason) since the counts ``graphs`` and ``breaks``."""
    new_breaks = {reason[:200]: n - breaks.get(reason, 0) for reason, n in graph_breaks().items()
                  if n > breaks.get(reason, 0)}
    return {"graphs": unique_graphs() - graphs, "graph_breaks": new_breaks}


def write_report(report: dict, out: str | None) -> dict:
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"[profile] wrote {out}")
    return report


def token_batch(args, model, drafter, eager_twin, timing: Timing, batch: int, bytes_per_s: float,
                rounds: int, host_bytes_per_s: float | None = None) -> dict:
    """A token model's measurements at one batch size (see the module doc); ``host_bytes_per_s``: the bandwidth
    streamed weights cross (None: none stream)."""
    windows = sorted({int(w) for w in args.windows.split(",")} | {1})
    N = model.grid[0] * model.grid[1]
    prefix = model.cache_slots(conditioning(model, 1), 0) - N  # conditioning (and layout) slots
    sampling = SamplingSettings(cfg_scale=3.0)
    streamed = streamed_bytes(model)
    floor_ms = ((weight_bytes_read(model) - streamed + kv_bytes_read(model, 2 * batch, prefix + N // 2)) / bytes_per_s
                + (streamed / host_bytes_per_s if streamed else 0)) * 1e3
    forward = forward_costs(model, timing, batch, windows)
    entry = {"floor_ms": floor_ms,
             "forward_ms": {str(w): ms for w, ms in forward.items()},
             "window_cost": {str(w): ms / forward[1] for w, ms in forward.items()},
             "forward_over_floor": forward[1] / floor_ms,
             # what attending over the filled slots only saves (transformer.attended_slots)
             "whole_cache_forward_ms": forward_costs(model, timing, batch, [1], whole_cache=True)[1]}
    if args.kernels:
        entry["kernels"] = forward_kernels(model, batch, windows)
    if eager_twin is not None:
        entry["eager"] = {"forward_ms": {str(w): ms for w, ms in forward_costs(eager_twin, timing, batch,
                                                                              windows).items()},
                          "max_logit_gap": logit_gaps(model, eager_twin, batch, windows)}
        with guards_in_full():  # what a repeated call saves by checking only the guards that tell graphs apart
            entry["full_guards_forward_ms"] = {str(w): ms for w, ms in forward_costs(model, timing, batch,
                                                                                    windows).items()}
    if args.no_decoders and not args.baselines:
        return entry
    names = args.decoders
    runs = decoder_runs(model, drafter, batch, sampling, names)
    if args.no_decoders:  # the baselines still need ar to compare with
        runs = {"ar": runs["ar"]}
    if eager_twin is not None:
        runs |= {f"eager {k}": run for k, run in decoder_runs(eager_twin, drafter, batch, sampling, names).items()
                 if k in runs}
    variants = ({name: under(context, runs["sjd"]) for name, (_, context) in SJD_VARIANTS.items()}
                if eager_twin is not None and "sjd" in runs else {})
    baselines = baseline_runs(args, eager_twin or model, batch, sampling) if args.baselines else {}
    costs, codes = image_costs(runs | variants | baselines, timing, rounds)
    for cost in costs.values():
        cost["over_floor"] = cost["ms_per_iteration"] / floor_ms
    entry["decoders"] = {k: c for k, c in costs.items() if k in runs and not k.startswith("eager ")}
    for name in variants:  # one sync per iteration: the host's time between steps is the GPU's idle time
        entry[SJD_VARIANTS[name][0]] = {"sjd": costs[name] | {"same_tokens": torch.equal(codes[name], codes["sjd"])}}
    if eager_twin is not None:  # the evidence that compiled steps may be on by default on this device
        entry["eager"]["decoders"] = {k[len("eager "):]: c for k, c in costs.items() if k.startswith("eager ")}
        entry["eager"]["same_tokens"] = {k: torch.equal(codes[k], codes[f"eager {k}"]) for k in entry["decoders"]}
    entry["baselines"] = {k: c | {"ar_speedup": c["image_s"] / costs["ar"]["image_s"]}
                          for k, c in costs.items() if k in baselines}
    entry["side_by_side"] = side_by_side(entry, {k: LOSSLESS[PROFILED[k].decoder] for k in entry["decoders"]})
    return entry


def print_batch(batch: int, entry: dict) -> None:
    print(f"[profile] batch {batch} (CFG, {2 * batch} rows): floor {entry['floor_ms']:.2f} ms, 1-token forward "
          f"{entry['forward_ms']['1']:.2f} ms ({entry['forward_over_floor']:.2f}x floor); c(W): "
          + ", ".join(f"{w}: {c:.2f}" for w, c in entry["window_cost"].items()), flush=True)
    print(f"[profile]   attending over the whole cache instead of its filled slots: 1-token forward "
          f"{entry['whole_cache_forward_ms']:.2f} ms", flush=True)
    for decoder, cost in entry.get("decoders", {}).items():
        print(f"[profile]   {decoder}: {cost['ms_per_iteration']:.2f} ms per iteration "
              f"({cost['over_floor']:.2f}x floor), {cost['target_forwards']:.0f} iterations per image, "
              f"{cost['image_s']:.3f} s per image", flush=True)
    for key, what in (("full_guards_decoders", "every compiled call guarded in full"),
                      ("eager_loop_step_decoders", "sampling and verification eager")):
        for decoder, cost in entry.get(key, {}).items():
            print(f"[profile]   {decoder}, {what}: {cost['ms_per_iteration']:.2f} ms per iteration "
                  f"({cost['over_floor']:.2f}x floor), {cost['image_s']:.3f} s per image; the same tokens: "
                  f"{'yes' if cost['same_tokens'] else 'NO'}", flush=True)
    for window, breakdown in entry.get("kernels", {}).items():
        print_breakdown(f"where a {window}-token forward's time goes", breakdown)
    if "eager" in entry:
        eager = entry["eager"]
        print("[profile]   eager (the same weights): 1-token forward "
              f"{eager['forward_ms']['1']:.2f} ms; " + ", ".join(
                  f"{decoder} {cost['image_s']:.3f} s per image" for decoder, cost in eager.get("decoders", {}).items()),
              flush=True)
        print(f"[profile]   compiled, every call guarded in full: 1-token forward "
              f"{entry['full_guards_forward_ms']['1']:.2f} ms (repeats skip most guards: "
              f"{entry['forward_ms']['1']:.2f} ms)", flush=True)
        print("[profile]   compiled vs eager: largest |logit difference| "
              + ", ".join(f"W={w}: {gap:.1e}" for w, gap in eager["max_logit_gap"].items())
              + ("; same tokens for the same seed: " + ", ".join(
                  f"{decoder} {'yes' if same else 'NO'}" for decoder, same in eager["same_tokens"].items())
                 if "same_tokens" in eager else ""), flush=True)
    for loop, cost in entry.get("baselines", {}).items():
        print(f"[profile]   {loop} (same weights): {cost['ms_per_iteration']:.2f} ms per token "
              f"({cost['over_floor']:.2f}x floor), {cost['image_s']:.3f} s per image: FastAR ar is "
              f"{cost['ar_speedup']:.2f}x faster", flush=True)
    if entry.get("side_by_side"):
        print(f"[profile]   side by side, batch {batch}:\n" + "\n".join(entry["side_by_side"]), flush=True)
