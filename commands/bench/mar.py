"""``python -m fastar bench --mar``: MAR's own sampler at several step counts against CSpD (both verify
modes, exact and relaxed) and LazyMAR-style feature reuse (a sweep of its knobs) on one MAR model, same classes
and seeds (bench.md).

Per row: target and draft calls per image, CSpD's acceptance rate and residual redraws, the share of plain MAR's
transformer work done (feature reuse), latency ratio
against plain MAR at ``--num-iter`` (batch 1 with CFG, interleaved runs, medians, image decode excluded),
class accuracy and Frechet distances in the demo classifier's feature space (against real procedural
images and against plain MAR at ``--num-iter``); one Pareto plot of quality against latency ratio.
"""
from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ...settings import cspd_from, masked_settings_from, reuse_from
from ...errors import FastARError
from ...model_loaders.shared.demo import DEMO_KL, DEMO_MAR
from ...model_loaders.shared.compiled import compiled_mode
from ...pipeline import class_conditioning, load_models
from ...samplers.masked_loops.cspd import REFERENCE_TEMPERATURE, CSpDSettings
from ...samplers.decoders import decode_masked
from ...samplers.masked_loops.feature_reuse import FeatureReuse
from ...samplers.masked_loops.masked import MaskedSettings
from .common import (CHUNK, frechet_against, latency_note, quality, quality_panels, real_features, require_matplotlib,
                    save_panels)

@dataclass(frozen=True)
class Row:
    label: str
    decoder: str  # "ar", "cspd" or "cspd-relaxed" (with reuse in its settings: "+reuse" in the stats)
    settings: MaskedSettings
    cspd: CSpDSettings


def rows_for(args, model) -> list[Row]:
    """The bench's rows for ``model`` (a MAR): plain MAR at --num-iter (or the model's own steps) first."""
    num_tokens = model.cfg.num_tokens
    base, cspd = replace(masked_settings_from(args, model), reuse=None), cspd_from(args)
    rows = [Row("mar", "ar", base, cspd)]  # the baseline first: every ratio is against it
    steps = [int(k) for k in args.mar_steps.split(",") if k.strip()]
    rows += [Row(f"mar@{k}", "ar", replace(base, num_iter=k), cspd)
             for k in steps if k != base.num_iter and k <= num_tokens]
    exact = replace(cspd, ratio_temperature=1.0, path_factor=False)
    rows += [Row(f"cspd-{mode}", "cspd", base, replace(exact, verify=mode)) for mode in ("steps", "merged")]
    # MarkXCloud/CSpD's rule: its temperature (or --cspd-temperature) and its path factor
    reference = replace(cspd, ratio_temperature=args.cspd_temperature or REFERENCE_TEMPERATURE, path_factor=True)
    rows += [Row(f"cspd-relaxed-{mode}", "cspd-relaxed", base, replace(reference, verify=mode))
             for mode in ("steps", "merged")]
    rows += reuse_rows(base, exact, reuse_of(args), steps)
    return chosen(rows, getattr(args, "mar_rows", None))


def chosen(rows: list[Row], labels: str | None) -> list[Row]:
    """``--mar-rows``: the rows named (the plain MAR row first, always); every row without it."""
    if not labels:
        return rows
    wanted = {label.strip() for label in labels.split(",") if label.strip()}
    unknown = wanted - {row.label for row in rows}
    if unknown:
        raise FastARError(f"--mar-rows: no row {', '.join(sorted(unknown))}; the rows are "
                          f"{', '.join(row.label for row in rows)}")
    return [row for row in rows if row.label == "mar" or row.label in wanted]


def reuse_of(args) -> FeatureReuse:
    """The reuse settings the lazy rows start from: --reuse-start and friends (their defaults without them)."""
    return reuse_from(args, always=True)


def reuse_rows(base: MaskedSettings, cspd: CSpDSettings, reuse: FeatureReuse, steps: list[int]) -> list[Row]:
    """LazyMAR-style reuse at the base steps (and a sweep of each knob around it, for the Pareto), at the most
    steps below the base (does reuse beat simply taking fewer steps?), and inside exact CSpD (``cspd``)."""
    variants = {"lazy": reuse}
    for share in (0.5, 0.9):
        variants[f"lazy-reuse{share:g}"] = replace(reuse, token_reuse=share)
    for every in (3, 8):
        variants[f"lazy-refresh{every}"] = replace(reuse, refresh_every=every)
    for start in (0.1, 0.2):  # the default and the earlier one: the row equal to the base is left out
        variants[f"lazy-start{start:g}"] = replace(reuse, start_percent=start)
    for every in (0, 3):  # 0: the transformer's reuse alone
        variants[f"lazy-head{every}"] = replace(reuse, head_refresh_every=every)
    # ReCAP's schedule (liebenxj/ReCAP) as the nearest point of this family: full steps for the first half, then
    # every other step, the cheap steps recomputing little more than their own and the fresh tokens, the head
    # exact. Not ReCAP itself: its cheap steps run both CFG branches (here the cached gap) from block 0, and use
    # fewer reverse steps
    variants["recap-like"] = FeatureReuse(start_percent=0.5, refresh_every=2, token_reuse=0.99, head_refresh_every=0)
    rows = [Row(label, "ar", replace(base, reuse=variant), cspd) for label, variant in variants.items()
            if label == "lazy" or variant != reuse]
    fewer = sorted(k for k in steps if k < base.num_iter)
    if len(fewer) > 1:  # against the plain row below it
        rows.append(Row(f"lazy@{fewer[-1]}", "ar", replace(base, num_iter=fewer[-1], reuse=reuse), cspd))
    # CSpD (the exact rule) with the same reuse: the draft's calls inside a round, and the target's in merged mode
    return rows + [Row(f"cspd-{mode}-lazy", "cspd", replace(base, reuse=reuse), replace(cspd, verify=mode))
                   for mode in ("steps", "merged")]


def run_row(models, labels: list[int], row: Row, seed: int):
    cond = class_conditioning(models.ar, labels)
    return decode_masked(models.ar, cond, row.settings, row.decoder, seed=seed, cspd=row.cspd,
                         drafter=models.drafter if row.decoder != "ar" else None)


def sample_many(models, row: Row, labels: list[int], seed: int):
    """Tokens for every label (chunks of CHUNK rows, one seed per chunk) and the summed counters."""
    tokens, totals = [], {"target": 0, "draft": 0, "drafted": 0, "accepted": 0, "tries": 0, "fallbacks": 0, "work": []}
    for start in range(0, len(labels), CHUNK):
        out, stats = run_row(models, labels[start : start + CHUNK], row, seed + start)
        tokens.append(out.cpu())
        totals["target"] += stats.target_forwards  # a call serves every row of its chunk: per image = per chunk
        totals["draft"] += stats.drafter_forwards
        totals["drafted"] += stats.drafted_tokens
        totals["accepted"] += stats.accepted_tokens
        totals["tries"] += stats.resample_tries
        totals["fallbacks"] += stats.resample_fallbacks
        totals["work"].append(1.0 if stats.transformer_work is None else stats.transformer_work)
    return torch.cat(tokens), totals


def timed_runs(models, rows: list[Row], runs: int, num_classes: int, seed: int) -> dict:
    """Batch-1 wall times (drafter included), interleaved so drift hits every row alike; medians."""
    times = {row.label: [] for row in rows}
    for row in rows:  # warm-up
        run_row(models, [0], row, seed)
    for r in range(runs):
        for row in rows:
            _, stats = run_row(models, [r % num_classes], row, seed + 1000 + r)
            times[row.label].append(stats.wall_time_s)
    return {label: statistics.median(t) for label, t in times.items()}


def run_mar_bench(args) -> dict:
    from .classifier import load_classifier
    from .demo_data import MAR_TOKEN

    started = time.perf_counter()
    require_matplotlib()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model_path = args.model or DEMO_MAR
    models = load_models(str(model_path), args.vq or str(DEMO_KL), args.device, args.dtype,
                         drafter_path=args.drafter or "demo", gpu_weights=args.gpu_weights, weights=args.weights,
                         compile_switch=args.compile)
    if models.ar.kind != "masked-ar":
        raise FastARError(f"bench --mar compares MAR decoders: {model_path} is {models.ar.what}; drop --mar to "
                          "bench a token model")
    rows = rows_for(args, models.ar)
    judge = load_classifier(device=models.ar.device)
    num_classes = models.ar.cfg.num_classes
    labels = [i % num_classes for i in range(args.samples)]
    # the demo MAR's own data (drawn for its 16-pixel tokens) is what its samples are compared with
    reference_feats = real_features(judge, MAR_TOKEN)
    chunks = -(-len(labels) // CHUNK)

    results = {}
    for row in rows:
        print(f"[bench] {row.label}: {args.samples} samples", flush=True)
        row_started = time.perf_counter()
        tokens, totals = sample_many(models, row, labels, args.seed)
        results[row.label] = {
            "decoder": row.decoder, "settings": asdict(row.settings),
            "cspd": asdict(row.cspd) if row.decoder != "ar" else None,
            "target_calls": totals["target"] / chunks, "draft_calls": totals["draft"] / chunks,
            "acceptance_rate": totals["accepted"] / totals["drafted"] if totals["drafted"] else None,
            "residual_tries_per_image": totals["tries"] / len(labels),
            "fallbacks_per_image": totals["fallbacks"] / len(labels),
            "transformer_work": statistics.mean(totals["work"]),
            **quality(models, judge, tokens, labels, reference_feats)}
        r = results[row.label]
        print(f"[bench] {row.label}: {r['target_calls']:.1f} target + {r['draft_calls']:.1f} draft calls, class "
              f"accuracy {100 * r['class_accuracy']:.1f}% ({time.perf_counter() - row_started:.0f} s)", flush=True)
    frechet_against(results, "mar")

    print(f"[bench] latency: {args.timing_runs} interleaved batch-1 runs per row", flush=True)
    medians = timed_runs(models, rows, args.timing_runs, num_classes, args.seed)
    for label, r in results.items():
        r["median_time_s"] = medians[label]
        r["latency_ratio"] = medians["mar"] / medians[label]

    report = {
        "model": str(model_path), "drafter": args.drafter or "bundled demo draft",
        "device": str(models.ar.device), "dtype": str(models.ar.dtype).replace("torch.", ""),
        "compiled": compiled_mode(models.ar),  # transformer calls and reverse steps (samplers/masked_loops/masked.py, head_steps.py)
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads", "samples": args.samples,
        "results": results, "bench_time_s": round(time.perf_counter() - started),
    }
    plot_pareto(results, out_dir / "pareto_mar.png")
    (out_dir / "bench_mar.json").write_text(json.dumps(report, indent=1))
    (out_dir / "bench_mar.md").write_text(markdown(report))
    print((out_dir / "bench_mar.md").read_text())
    return report


def markdown(report: dict) -> str:
    base = report["results"]["mar"]["settings"]
    lines = [
        f"# FastAR MAR benchmark ({report['model']}, {report['device']}, {report['dtype']}"
        + (f", compiled steps ({report['compiled']})" if report.get("compiled") else "") + f", {report['samples']} "
        f"samples per row; cfg {base['cfg_scale']} {base['cfg_schedule']}, temperature {base['temperature']}, "
        f"{base['diffusion_steps']} diffusion steps)",
        "",
        "| row | steps | target calls / image | draft calls / image | acceptance | residual redraws / image "
        "| transformer work | latency ratio | class accuracy | Frechet (real) | Frechet (vs mar) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, r in report["results"].items():
        acceptance = "-" if r["acceptance_rate"] is None else f"{100 * r['acceptance_rate']:.1f}%"
        lines.append(
            f"| {label} | {r['settings']['num_iter']} | {r['target_calls']:.1f} | {r['draft_calls']:.1f} | "
            f"{acceptance} | {r['residual_tries_per_image']:.1f} | {100 * r['transformer_work']:.0f}% | "
            f"{r['latency_ratio']:.2f}x | "
            f"{100 * r['class_accuracy']:.1f}% | {r['frechet']:.2f} | {r['frechet_vs_mar']:.2f} |")
    lines += ["", latency_note(report)]
    return "\n".join(lines) + "\n"


def plot_pareto(results: dict, path: Path) -> None:
    fig, axes = quality_panels()
    import matplotlib.pyplot as plt

    plain = sorted((r for r in results.values() if r["decoder"] == "ar" and r["settings"]["reuse"] is None),
                   key=lambda r: r["latency_ratio"])
    for ax, metric, title in ((axes[0], "class_accuracy", "class accuracy"),
                              (axes[1], "frechet", "Frechet distance to real images (lower is better)")):
        ax.plot([r["latency_ratio"] for r in plain], [r[metric] for r in plain], "o-", color="k",
                label="plain MAR (steps)")
        for r in plain:
            ax.annotate(str(r["settings"]["num_iter"]), (r["latency_ratio"], r[metric]), textcoords="offset points",
                        xytext=(3, 3), fontsize=7)
        others = [(label, r) for label, r in results.items() if r not in plain]
        colours = plt.get_cmap("tab20").colors  # one colour per row (tab10's cycle repeated them)
        for (label, r), colour in zip(others, colours):
            marker = "^" if r["settings"]["reuse"] else "s"
            ax.plot([r["latency_ratio"]], [r[metric]], marker, markersize=8, label=label, color=colour)
        ax.set_xlabel("speed-up over plain MAR at the default steps (latency ratio)")
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
    save_panels(fig, axes, "FastAR on MAR: fewer steps vs speculative decoding (CSpD) and feature reuse", path)
