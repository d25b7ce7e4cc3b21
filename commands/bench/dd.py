"""``python -m fastar bench --dd``: a Distilled Decoding student in one and two steps against its teacher's
plain AR (and the flow-map AR its training pairs come from), same classes (bench.md).

Rows: ``ar`` and ``fm`` (the teacher at the student's dataset settings: ``--cfg``, default 2.0, the DD
paper's, and ``--temperature``/``--top-k``/``--top-p``), ``dd-1``, ``dd-2`` and ``dd-hybrid`` (the paper's Alg. 4: the teacher samples positions
``--dd-regenerate``..t2-1 between the two steps; default the second half of them). ``--dd-t2`` and
``--dd-split`` apply to every DD row. Per row: model forwards per image, latency ratio against ``ar``
(batch 1, interleaved runs, medians, image decode excluded), class accuracy of the demo classifier and
Frechet distances in its feature space (against real procedural images and against ``ar``); the Pareto plot
(``pareto_dd.png``) puts each row's quality against its speed-up.
"""
from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ...settings import sampling_from
from ...errors import FastARError
from ...model_loaders.shared.demo import DEMO_AR, DEMO_DD, DEMO_VAR, demo_image_decoder
from ...pipeline import LoadedModels, check_image_decoder, class_conditioning, load_models
from ...samplers.decoders import NEXT_SCALE, DecoderSpec, decode, decode_distilled, decode_next_scale
from ...samplers.few_step_loops.distilled import DDSettings
from ...samplers.processing import SamplingSettings
from .common import (CHUNK, frechet_against, latency_note, quality, quality_panels, real_features, require_matplotlib,
                    save_panels)


@dataclass(frozen=True)
class Row:
    label: str
    steps: int  # DD steps; 0 = the teacher (``decoder``)
    decoder: str = "ar"
    hybrid: bool = False  # the teacher regenerates part of the first step's codes


ROWS = (Row("ar", 0), Row("fm", 0, "fm"), Row("dd-1", 1, "dd"), Row("dd-2", 2, "dd"),
        Row("dd-hybrid", 2, "dd", hybrid=True))
# a VAR student's teacher: the same rows but the hybrid (the teacher regenerates raster positions, not scales)
VAR_ROWS = tuple(row for row in ROWS if not row.hybrid)


def dd_settings(args, student) -> DDSettings:
    """The DD rows' settings from the command line; the hybrid's regenerate position defaults to t2 // 2."""
    return DDSettings(t2=args.dd_t2, split=args.dd_split).hybrid(student, args.dd_regenerate)


def run_row(teacher: LoadedModels, student: LoadedModels, row: Row, labels: list[int], seed: int,
            sampling: SamplingSettings, dd: DDSettings):
    if row.steps == 0 and teacher.ar.kind == NEXT_SCALE:
        return decode_next_scale(teacher.ar, class_conditioning(teacher.ar, labels), sampling, seed=seed,
                                 vqvae=teacher.vq, decoder=row.decoder)
    if row.steps == 0:
        return decode(teacher.ar, class_conditioning(teacher.ar, labels), sampling, DecoderSpec(row.decoder),
                      seed=seed, codebook=teacher.codebook())
    settings = replace(dd, steps=row.steps, regenerate=dd.regenerate if row.hybrid else None)
    return decode_distilled(student.ar, class_conditioning(student.ar, labels), settings, seed=seed,
                            codebook=student.codebook(), teacher=teacher.ar if row.hybrid else None, sampling=sampling)


def run_dd_bench(args) -> dict:
    from .classifier import load_classifier
    from .demo_data import MAR_TOKEN

    require_matplotlib()
    started = time.perf_counter()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    student_path = args.model or DEMO_DD
    if not Path(student_path).exists():
        raise FastARError(f"{student_path} does not exist: give a DD student (--model) and its teacher (--teacher), "
                          "or make the demo one with python -m fastar distill-dd")
    # its kind picks the default decoder
    student = load_models(str(student_path), None, args.device, args.dtype, gpu_weights=args.gpu_weights,
                          weights=args.weights)
    if student.ar.kind != "few-step":
        raise FastARError(f"bench --dd needs a Distilled Decoding student as --model; {student_path} is "
                          f"{student.ar.what}")
    is_var = getattr(student.ar, "decoder_kind", None) == "multi-scale"
    teacher_path = args.teacher or str(DEMO_VAR if is_var else DEMO_AR)
    vq = args.vq or demo_image_decoder(teacher_path)
    if vq is None:
        raise FastARError(f"bench --dd decodes images: give the teacher's image decoder (--vq: its VQ, or a VAR's "
                          f"VQVAE) for {Path(teacher_path).name}")
    teacher = load_models(teacher_path, vq, args.device, args.dtype, gpu_weights=args.gpu_weights, weights=args.weights)
    check_image_decoder(student.ar, teacher.vq)
    student.vq = teacher.vq
    rows = VAR_ROWS if is_var else ROWS
    sampling = sampling_from(args)  # the pairs' settings, which the teacher's rows sample at
    dd = dd_settings(args, student.ar)
    judge = load_classifier(device=student.ar.device)
    num_classes = student.ar.cfg.num_classes
    labels = [i % num_classes for i in range(args.samples)]
    token = MAR_TOKEN if is_var else 8  # the demo VAR learnt the MAR demo's images (16-pixel tokens)
    reference_feats = real_features(judge, token)

    results = {}
    for row in rows:
        models = teacher if row.steps == 0 else student
        outputs, forwards = [], []
        for start in range(0, len(labels), CHUNK):
            out, stats = run_row(teacher, student, row, labels[start : start + CHUNK], args.seed + start, sampling,
                                 dd)
            outputs.append(out.cpu())
            forwards.append(stats.target_forwards)
        results[row.label] = {"forwards_per_image": float(np.mean(forwards)),
                              **quality(models, judge, torch.cat(outputs), labels, reference_feats)}
        print(f"[bench] {row.label}: class accuracy {100 * results[row.label]['class_accuracy']:.1f}%", flush=True)
    frechet_against(results, "ar")

    times = {row.label: [] for row in rows}
    for row in rows:  # warm-up
        run_row(teacher, student, row, [0], args.seed, sampling, dd)
    for r in range(args.timing_runs):
        for row in rows:
            _, stats = run_row(teacher, student, row, [r % num_classes], args.seed + 1000 + r, sampling, dd)
            times[row.label].append(stats.wall_time_s)
    medians = {label: statistics.median(t) for label, t in times.items()}
    for label, r in results.items():
        r["median_time_s"] = medians[label]
        r["latency_ratio"] = medians["ar"] / medians[label]

    report = {"student": Path(student_path).name, "teacher": Path(teacher_path).name, "cfg": sampling.cfg_scale,
              "top_k": sampling.top_k, "top_p": sampling.top_p,
              "dd": {"t2": dd.t2, "split": dd.split, "regenerate": dd.regenerate},
              "device": str(student.ar.device), "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
              "samples": args.samples, "results": results, "bench_time_s": round(time.perf_counter() - started)}
    (out_dir / "bench_dd.json").write_text(json.dumps(report, indent=1))
    (out_dir / "bench_dd.md").write_text(markdown(report))
    plot_pareto(results, out_dir / "pareto_dd.png")
    print((out_dir / "bench_dd.md").read_text())
    return report


def markdown(report: dict) -> str:
    dd = report["dd"]
    hybrid = (f"; dd-hybrid: the teacher samples positions {dd['regenerate']}..{dd['t2'] - 1}"
              if "dd-hybrid" in report["results"] else "")
    lines = [f"# FastAR DD benchmark ({report['student']} from {report['teacher']}, {report['device']}, "
             f"{report['samples']} samples per row, teacher cfg {report['cfg']}, top-k {report['top_k']}, "
             f"top-p {report['top_p']})", "",
             f"DD: t2 {dd['t2']}, split {dd['split']}{hybrid}.", "",
             "| row | forwards / image | latency ratio | class accuracy | Frechet (real) | Frechet (vs ar) |",
             "|---|---|---|---|---|---|"]
    for label, r in report["results"].items():
        lines.append(f"| {label} | {r['forwards_per_image']:.0f} | {r['latency_ratio']:.1f}x | "
                     f"{100 * r['class_accuracy']:.1f}% | {r['frechet']:.2f} | {r['frechet_vs_ar']:.2f} |")
    lines += ["", latency_note(report)]
    return "\n".join(lines) + "\n"


def plot_pareto(results: dict, path: Path) -> None:
    fig, axes = quality_panels()
    for ax, metric, title in ((axes[0], "class_accuracy", "class accuracy"),
                              (axes[1], "frechet", "Frechet distance to real images (lower is better)")):
        for label, r in results.items():
            ax.plot([r["latency_ratio"]], [r[metric]], "*" if label == "ar" else "o", markersize=9, label=label)
        ax.set_xscale("log")
        ax.set_xlabel("speed-up over plain AR (latency ratio, log scale)")
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
    save_panels(fig, axes, "FastAR Distilled Decoding: quality against speed-up", path)
