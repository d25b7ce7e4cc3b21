"""``python -m fastar bench``: decoders side by side on one model, same classes and seeds (bench.md).

Measures, per decoder: step compression (image tokens per target forward, per row), mean accepted
tokens per iteration, latency ratio against plain AR (batch 1 with CFG, interleaved runs, medians,
VQ decode excluded), class accuracy and a Frechet distance in the demo classifier's feature space
(against real procedural images and against plain AR's samples), the window cost c(W), slider
sweeps for the Pareto plot, and the total-variation distance of relaxed decoders on the toy model.
"""
from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

from ..cli import sampling_from, spec_from
from ..errors import FastARError
from ..model_loaders.protocol import ClassConditioning
from ..pipeline import class_conditioning, codes_to_images, load_models
from ..samplers.decoders import DECODERS, LOSSLESS, DecoderSpec, decode
from ..samplers.processing import SamplingSettings

CHUNK = 16  # rows per batched quality run
REAL_IMAGES = 512
WINDOW_COSTS = (1, 2, 4, 8, 16, 32)
SWEEP_GROUPS = (1, 3, 10, 25, 50, 100)
SWEEP_WINDOWS = (4, 8, 16, 32)


def sample_many(models, sampling, spec: DecoderSpec, labels: list[int], seed: int):
    """Codes for every label (batched in chunks, one seed per chunk) and per-row forward counts."""
    codes, row_forwards, accepted = [], [], []
    for start in range(0, len(labels), CHUNK):
        cond = class_conditioning(models.ar, labels[start : start + CHUNK])
        out, stats = decode(models.ar, cond, sampling, spec, seed=seed + start)
        codes.append(out.cpu())
        row_forwards += stats.row_forwards
        accepted += [c for it in stats.accepted_per_iteration for c in it if c > 0]
    return torch.cat(codes), row_forwards, accepted


def quality(models, judge, codes: torch.Tensor, labels: list[int], reference_feats) -> dict:
    from .classifier import classify, frechet_distance

    images = codes_to_images(models.vq, codes, models.ar.grid)
    preds, feats = classify(judge, images)
    accuracy = float((np.asarray(preds) == np.asarray(labels)).mean())
    return {"class_accuracy": accuracy, "frechet": frechet_distance(feats, reference_feats), "_feats": feats}


def speed(row_forwards: list[int], accepted: list[int], num_tokens: int) -> dict:
    return {
        "step_compression": num_tokens * len(row_forwards) / sum(row_forwards),
        "mean_accepted": float(np.mean(accepted)),
        "accepted_histogram": np.bincount(accepted).tolist(),
    }


def timed_runs(models, sampling, specs: dict[str, DecoderSpec], runs: int, num_classes: int, seed: int) -> dict:
    """Batch-1 wall times, interleaved A B C A B C ... so drift hits every decoder alike."""
    times = {name: [] for name in specs}
    cond = class_conditioning(models.ar, [0])
    for spec in specs.values():  # warm-up
        decode(models.ar, cond, sampling, spec, seed=seed)
    for r in range(runs):
        cond = class_conditioning(models.ar, [r % num_classes])
        for name, spec in specs.items():
            _, stats = decode(models.ar, cond, sampling, spec, seed=seed + 1000 + r)
            times[name].append(stats.wall_time_s)
    return {name: statistics.median(t) for name, t in times.items()}


@torch.no_grad()
def window_costs(model, cfg: bool, repeats: int = 20) -> dict:
    """c(W): time of one forward over W tokens / time of a single-token forward (cache half full)."""
    N = model.grid[0] * model.grid[1]
    cond = ClassConditioning(torch.zeros(1, dtype=torch.long, device=model.device))
    session = model.start(cond, cfg=cfg, max_window=max(WINDOW_COSTS))
    start = torch.full((1,), N // 2, dtype=torch.long, device=model.device)
    seconds = {}
    for width in WINDOW_COSTS:
        tokens = torch.zeros(1, width, dtype=torch.long, device=model.device)
        session.forward(tokens, start)
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            session.forward(tokens, start)
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            samples.append(time.perf_counter() - t0)
        seconds[width] = statistics.median(samples)
    return {str(w): seconds[w] / seconds[1] for w in WINDOW_COSTS}


def toy_total_variation(spec: DecoderSpec, groups=(1, 3, 5), rows: int = 20000) -> dict:
    """Measured TV distance to the exact target on the enumerable toy (6 codes, 3 tokens)."""
    from .toy_model import ToyModel

    toy = ToyModel(vocab=6, grid=(1, 3), num_classes=1, scale=1.5, seed=0)
    sampling = SamplingSettings(cfg_scale=2.0)
    exact = toy.exact_joint(0, cfg_scale=2.0)
    cond = ClassConditioning(torch.zeros(rows, dtype=torch.long))
    noise_floor = None
    out = {}
    for g in groups:
        codes, _ = decode(toy, cond, sampling, replace(spec, decoder="gsd", group=g, window=3), seed=g)
        empirical = torch.bincount(toy.index_of(codes), minlength=len(exact)).double() / rows
        out[str(g)] = float(0.5 * (empirical - exact).abs().sum())
        if g == 1:
            noise_floor = out[str(g)]  # G=1 is exact: its TV is pure sampling noise
    return {"rows": rows, "tv_by_group": out, "noise_floor": noise_floor}


def sweep(models, judge, sampling, base: DecoderSpec, labels, seed, reference_feats) -> list[dict]:
    """Speed/quality points over GSD's group size and SJD's window and coupling."""
    configs = [replace(base, decoder="gsd", group=g) for g in SWEEP_GROUPS]
    configs += [replace(base, decoder="sjd", window=w, coupling=c) for w in SWEEP_WINDOWS
                for c in ("independent", "maximal")]
    points = []
    for spec in configs:
        codes, forwards, accepted = sample_many(models, sampling, spec, labels, seed)
        q = quality(models, judge, codes, labels, reference_feats)
        q.pop("_feats")
        points.append({"spec": spec.as_dict(), **speed(forwards, accepted, codes.shape[1]), **q})
    return points


def run_bench(args) -> dict:
    from .classifier import classify, frechet_distance, load_classifier
    from .demo_data import make_batch

    names = [n.strip() for n in args.decoders.split(",") if n.strip()]
    unknown = [n for n in names if n not in DECODERS]
    if unknown or not names:
        raise FastARError(f"unknown decoder(s) {unknown}: choose from {', '.join(DECODERS)}")
    if "ar" not in names:
        names = ["ar"] + names  # every ratio is against plain AR, measured in the same run
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    models = load_models(args.model, args.vq, args.device, args.dtype)
    if models.vq is None:
        raise FastARError("the benchmark decodes images: give --vq with --model")
    sampling = sampling_from(args)
    judge = load_classifier(device=models.ar.device)
    num_classes = models.ar.cfg.num_classes
    labels = [i % num_classes for i in range(args.samples)]
    specs = {name: spec_from(args, name) for name in names}
    real_images, _ = make_batch(np.random.default_rng(12345), REAL_IMAGES)
    reference_feats = classify(judge, real_images)[1]
    num_tokens = models.ar.grid[0] * models.ar.grid[1]

    results = {}
    for name, spec in specs.items():
        print(f"[bench] {name}: {args.samples} samples", flush=True)
        codes, forwards, accepted = sample_many(models, sampling, spec, labels, args.seed)
        results[name] = {"lossless": LOSSLESS[name], "spec": spec.as_dict(), **speed(forwards, accepted, num_tokens),
                         **quality(models, judge, codes, labels, reference_feats)}
    ar_feats = results["ar"]["_feats"]
    for r in results.values():
        r["frechet_vs_ar"] = frechet_distance(r.pop("_feats"), ar_feats)

    print(f"[bench] latency: {args.timing_runs} interleaved batch-1 runs per decoder", flush=True)
    medians = timed_runs(models, sampling, specs, args.timing_runs, num_classes, args.seed)
    for name, r in results.items():
        r["median_time_s"] = medians[name]
        r["latency_ratio"] = medians["ar"] / medians[name]

    report = {
        "model": str(args.model or "bundled demo model"),
        "device": str(models.ar.device),
        "dtype": str(models.ar.dtype).replace("torch.", ""),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "samples": args.samples,
        "sampling": asdict(sampling),
        "results": results,
        "window_cost": window_costs(models.ar, sampling.use_cfg),
    }
    if "gsd" in specs:
        print("[bench] toy total-variation distance of GSD", flush=True)
        report["toy_tv_gsd"] = toy_total_variation(specs["gsd"])
    if not args.no_pareto:
        print("[bench] slider sweeps for the Pareto plot", flush=True)
        sweep_labels = labels[: args.sweep_samples or max(num_classes, args.samples // 2)]
        report["pareto"] = sweep(models, judge, sampling, specs.get("sjd", spec_from(args, "sjd")),
                                 sweep_labels, args.seed, reference_feats)
        plot_pareto(report["pareto"], results, out_dir / "pareto.png")
    (out_dir / "bench.json").write_text(json.dumps(report, indent=1))
    (out_dir / "bench.md").write_text(markdown(report))
    print((out_dir / "bench.md").read_text())
    return report


def markdown(report: dict) -> str:
    lines = [
        f"# FastAR benchmark ({report['model']}, {report['device']}, {report['dtype']}, {report['samples']} samples per decoder)",
        "",
        "| decoder | lossless | step compression | mean accepted | latency ratio | class accuracy | Frechet (real) | Frechet (vs AR) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["results"].items():
        lines.append(
            f"| {name} | {'yes' if r['lossless'] else 'no'} | {r['step_compression']:.2f}x | {r['mean_accepted']:.2f} | "
            f"{r['latency_ratio']:.2f}x | {100 * r['class_accuracy']:.1f}% | {r['frechet']:.2f} | {r['frechet_vs_ar']:.2f} |"
        )
    costs = ", ".join(f"c({w})={c:.2f}" for w, c in report["window_cost"].items())
    lines += ["", f"Window cost on {report['device']} ({report['machine']}): {costs}."]
    if "toy_tv_gsd" in report:
        tv = report["toy_tv_gsd"]
        per_group = ", ".join(f"G={g}: {v:.4f}" for g, v in tv["tv_by_group"].items())
        lines += ["", f"GSD total-variation distance to the exact target on the toy model ({tv['rows']} rows; "
                      f"G=1 is exact, so its value is the sampling-noise floor): {per_group}."]
    if "pareto" in report:
        lines += ["", "| sweep point | step compression | class accuracy | Frechet (real) |", "|---|---|---|---|"]
        for p in report["pareto"]:
            s = p["spec"]
            label = f"gsd G={s['group']}" if s["decoder"] == "gsd" else f"sjd W={s['window']} {s['coupling']}"
            lines.append(f"| {label} | {p['step_compression']:.2f}x | {100 * p['class_accuracy']:.1f}% | {p['frechet']:.2f} |")
    return "\n".join(lines) + "\n"


def plot_pareto(points: list[dict], results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    series = {
        "GSD (group size)": [p for p in points if p["spec"]["decoder"] == "gsd"],
        "SJD independent (window)": [p for p in points if p["spec"]["decoder"] == "sjd" and p["spec"]["coupling"] == "independent"],
        "SJD maximal coupling (window)": [p for p in points if p["spec"]["decoder"] == "sjd" and p["spec"]["coupling"] == "maximal"],
    }
    for ax, metric, title in ((axes[0], "class_accuracy", "class accuracy"), (axes[1], "frechet", "Frechet distance (lower is better)")):
        for label, pts in series.items():
            xs = [p["step_compression"] for p in pts]
            ys = [p[metric] for p in pts]
            ax.plot(xs, ys, "o-", label=label)
            key = "group" if label.startswith("GSD") else "window"
            for p, x, y in zip(pts, xs, ys):
                ax.annotate(str(p["spec"][key]), (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7)
        ar = results["ar"]
        ax.plot([ar["step_compression"]], [ar[metric]], "k*", markersize=10, label="plain AR")
        ax.set_xlabel("step compression (tokens per target forward)")
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("FastAR speed/quality trade-off on the demo model")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
