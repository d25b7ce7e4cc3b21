"""``python -m fastar generate|bench|train-drafter``: the command line."""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

from .errors import FastARError, FastARWarning
from .samplers.acceptance import PROB_FILTERS
from .samplers.decoders import DECODERS, LOSSLESS, NEEDS_DRAFTER, DecoderSpec
from .samplers.drafts import COUPLINGS, INIT_STRATEGIES
from .samplers.processing import SamplingSettings
from .tools.train_drafter import add_arguments as add_drafter_training_args

SPEC_DEFAULTS = DecoderSpec()
SAMPLING_DEFAULTS = SamplingSettings()


def add_decoding_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="AR checkpoint file or HF folder (default: the bundled demo model)")
    p.add_argument("--vq", help="VQ tokenizer checkpoint (default: the bundled demo VQ when --model is not given)")
    p.add_argument("--image-size", type=int, help="image size in pixels (square), for a checkpoint that does not say "
                   "it or to run at another size (default: from its training args, config or file name, e.g. 384 for "
                   "c2i_L_384.pt)")
    p.add_argument("--cfg", type=float, default=SAMPLING_DEFAULTS.cfg_scale, help="classifier-free guidance (1 = off)")
    p.add_argument("--temperature", type=float, default=SAMPLING_DEFAULTS.temperature, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=SAMPLING_DEFAULTS.top_k, help="0 = off")
    p.add_argument("--top-p", type=float, default=SAMPLING_DEFAULTS.top_p, help="1 = off")
    p.add_argument("--window", type=int, default=SPEC_DEFAULTS.window,
                   help="SJD/GSD: tokens per forward (last fixed token + drafts)")
    p.add_argument("--init", choices=INIT_STRATEGIES, default=SPEC_DEFAULTS.init, help="SJD/GSD: draft initialisation")
    p.add_argument("--coupling", choices=COUPLINGS, default=SPEC_DEFAULTS.coupling,
                   help="SJD/GSD: how drafts are redrawn after a rejection (all lossless)")
    p.add_argument("--group", type=int, default=SPEC_DEFAULTS.group, help="GSD group size G (1 = SJD)")
    p.add_argument("--prob-threshold", type=float, default=SPEC_DEFAULTS.prob_threshold,
                   help="GSD delta: drop group members whose probability differs from the draft's by more")
    p.add_argument("--prob-filter", choices=PROB_FILTERS, default=SPEC_DEFAULTS.prob_filter,
                   help="GSD: measure that difference relative to the larger probability (means the same on "
                   "confident and flat models) or absolute (the paper's rule)")
    p.add_argument("--distance-threshold", type=float, default=SPEC_DEFAULTS.distance_threshold,
                   help="GSD d: keep group members among the draft's nearest codes (0.5 = nearer half, 1 = all)")
    p.add_argument("--drafter", help="spec/lantern/gsd: a drafter to draft chains with: a LANTERN/EAGLE drafter "
                   "folder or a smaller AR checkpoint of the same family; 'demo' = the bundled demo drafter "
                   "(default for spec on the demo model). Without one, lantern and gsd draft Jacobi windows (for lantern "
                   "much faster but at a large quality loss: use a drafter)")
    p.add_argument("--gamma", type=int, default=SPEC_DEFAULTS.gamma, help="drafter: drafts per target forward")
    p.add_argument("--lantern-k", type=int, default=SPEC_DEFAULTS.lantern_k,
                   help="LANTERN k: latent neighbours considered per draft (capped at the codebook size)")
    p.add_argument("--lantern-delta", type=float, default=SPEC_DEFAULTS.lantern_delta,
                   help="LANTERN delta: total-variation budget per token (0 = exact speculative decoding)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "fp16", "bf16"])
    p.add_argument("--threads", type=int, help="CPU threads for PyTorch (default: its own, one per core, the fastest "
                   "on an idle machine; when other jobs keep the cores busy, --threads 1 can be several times faster)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fastar", description="Fast autoregressive image generation.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate images with one decoder")
    add_decoding_args(gen)
    which = gen.add_mutually_exclusive_group()
    which.add_argument("--class", dest="class_", help="class index or name, repeated over --batch")
    which.add_argument("--classes", help="comma-separated classes, one per row")
    gen.add_argument("--prompt", action="append", help="text-to-image models: a prompt (repeat for several rows)")
    gen.add_argument("--t5", help="text-to-image models: local FLAN-T5 folder (google/flan-t5-xl)")
    gen.add_argument("--batch", type=int, default=1)
    gen.add_argument("--decoder", choices=DECODERS, default="sjd")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--out", help="PNG path (batch > 1: PATH_0.png, PATH_1.png, ...)")
    gen.add_argument("--tokens-out", help="write the image codes as JSON")
    gen.add_argument("--stats-out", help="write the decode statistics as JSON")
    gen.add_argument("--map-out", help="write the acceptance heatmap (iteration that fixed each token) as PNG")
    gen.add_argument("--quiet", action="store_true", help="no progress line")

    bench = sub.add_parser("bench", help="compare decoders side by side on the demo model")
    add_decoding_args(bench)
    bench.add_argument("--decoders", default="ar,sjd,gsd,spec,lantern,lantern-jacobi",
                       help=f"comma-separated, from {', '.join(DECODERS)}; NAME-jacobi drafts Jacobi windows, "
                       "NAME-drafter chains from the drafter (spec and lantern use the drafter by default)")
    bench.add_argument("--samples", type=int, default=64, help="images per decoder for the quality metrics")
    bench.add_argument("--timing-runs", type=int, default=5, help="batch-1 runs per decoder for latency (interleaved)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--out", required=True, help="output folder for bench.json, bench.md, pareto.png")
    bench.add_argument("--sweep-samples", type=int, help="images per slider-sweep point (default: half of --samples)")
    bench.add_argument("--no-pareto", action="store_true", help="skip the slider sweeps (faster)")
    bench.add_argument("--toy-rows", type=int, default=20000,
                       help="samples per setting for the relaxed decoders' total-variation distance on the toy")

    drafter = sub.add_parser("train-drafter", help="train a drafter (EAGLE head or small AR) on a target's samples")
    add_drafter_training_args(drafter)
    return parser


def spec_from(args, decoder: str) -> DecoderSpec:
    return DecoderSpec(decoder=decoder, window=args.window, init=args.init, coupling=args.coupling,
                       group=args.group, prob_threshold=args.prob_threshold, prob_filter=args.prob_filter,
                       distance_threshold=args.distance_threshold, gamma=args.gamma, lantern_k=args.lantern_k,
                       lantern_delta=args.lantern_delta)


def drafter_choice(args, decoder: str) -> str | None:
    """The drafter path for ``decoder``: --drafter, or the demo drafter for exact speculative decoding on
    the demo model; None (Jacobi drafts) otherwise."""
    if args.drafter:
        return args.drafter
    return "demo" if decoder in NEEDS_DRAFTER and args.model is None else None


def sampling_from(args) -> SamplingSettings:
    return SamplingSettings(cfg_scale=args.cfg, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p).validate()


class ProgressLine:
    """A one-line progress display on stderr, redrawn at most ten times a second. ``done`` counts the
    tokens of the slowest row; the rate is of the whole batch."""

    def __init__(self, label: str, enabled: bool, batch: int = 1):
        self.label, self.enabled, self.batch = label, enabled, batch
        self.start, self.last = time.perf_counter(), 0.0

    def __call__(self, done: int, total: int, _tokens) -> None:
        now = time.perf_counter()
        if not self.enabled or (now - self.last < 0.1 and done < total):
            return
        self.last = now
        rate = self.batch * done / max(now - self.start, 1e-9)
        bar = "#" * int(30 * done / total)
        rows = f" ({self.batch} images)" if self.batch > 1 else ""
        print(f"\r{self.label} [{bar:<30}] {done}/{total} tokens{rows}  {rate:.0f} tok/s", end="", file=sys.stderr)
        if done >= total:
            print(file=sys.stderr)


def numbered(path: Path, index: int, count: int) -> Path:
    return path if count == 1 else path.with_name(f"{path.stem}_{index}{path.suffix}")


def command_generate(args) -> int:
    from PIL import Image

    from .pipeline import codes_to_images, conditioning_for, load_models
    from .samplers.decoders import decode
    from .samplers.stats import acceptance_heatmap

    models = load_models(args.model, args.vq, args.device, args.dtype, drafter_path=drafter_choice(args, args.decoder),
                         image_size=args.image_size)
    classes = args.classes.split(",") if args.classes else [args.class_] if args.class_ else None
    conditioning = conditioning_for(models.ar, classes=classes, batch=args.batch, prompts=args.prompt,
                                    t5_folder=args.t5)
    spec, sampling = spec_from(args, args.decoder), sampling_from(args)
    kind = "lossless" if LOSSLESS[spec.decoder] else "relaxed (trades fidelity for speed)"
    progress = ProgressLine(f"{spec.decoder} ({kind})", enabled=not args.quiet, batch=conditioning.batch)
    codes, stats = decode(models.ar, conditioning, sampling, spec, seed=args.seed, on_iteration=progress,
                          drafter=models.drafter, codebook=models.codebook())
    grid = models.ar.grid

    drafted = f", {stats.drafter_forwards} drafter forwards ({stats.drafter_time_s:.2f} s)" if models.drafter else ""
    print(f"{stats.decoder}: {stats.num_tokens} tokens x {stats.batch} in {stats.target_forwards} forwards "
          f"(step compression {stats.step_compression:.2f}x, mean accepted {stats.mean_accepted:.2f}){drafted}, "
          f"{stats.wall_time_s:.2f} s")
    tokens_out = args.tokens_out
    if args.out and models.vq is None and not tokens_out:  # no images without a VQ: keep the codes instead
        tokens_out = Path(args.out).with_suffix(".tokens.json")
        Path(tokens_out).parent.mkdir(parents=True, exist_ok=True)
    if tokens_out:
        Path(tokens_out).write_text(json.dumps({"tokens": codes.tolist(), "grid": list(grid)}))
    if args.stats_out:
        Path(args.stats_out).write_text(json.dumps(stats.to_json(), indent=1))
    if args.map_out:
        for i, row in enumerate(stats.fixed_at):
            Image.fromarray(acceptance_heatmap(row, grid)).save(numbered(Path(args.map_out), i, stats.batch))
    if args.out:
        if models.vq is None:
            print(f"no images written: the model's VQ decoder is needed to make them (give --vq). The image "
                  f"codes are in {tokens_out}", file=sys.stderr)
        else:
            images = codes_to_images(models.vq, codes, grid)
            out = Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            for i, image in enumerate(images):
                Image.fromarray(image).save(numbered(out, i, len(images)))
            print(f"wrote {len(images)} image(s) to {out}" + ("" if len(images) == 1 else " (numbered)"))
    return 0


def command_bench(args) -> int:
    from .tools.bench import run_bench

    run_bench(args)
    return 0


def command_train_drafter(args) -> int:
    from .tools.train_drafter import train

    train(args)
    return 0


def show_warning(message, category, filename, lineno, file=None, line=None):
    """FastAR's own warnings as one plain line; others as Python prints them."""
    if issubclass(category, FastARWarning):
        print(f"warning: {message}", file=sys.stderr)
    else:
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def set_threads(threads: int | None) -> None:
    if threads is None:
        return
    if threads < 1:
        raise FastARError(f"--threads {threads}: give at least 1 (or leave it out for PyTorch's default)")
    import torch

    torch.set_num_threads(threads)


def main(argv=None) -> int:
    warnings.showwarning = show_warning
    args = build_parser().parse_args(argv)
    try:
        set_threads(getattr(args, "threads", None))
        commands = {"generate": command_generate, "bench": command_bench, "train-drafter": command_train_drafter}
        return commands[args.command](args)
    except FastARError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
