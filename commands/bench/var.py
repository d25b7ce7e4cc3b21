"""``python -m fastar bench --var``: VAR's plain sampler against FastVAR's and SkipVAR's settings on the demo VAR
(or ``--model``/``--vq``), the same classes and seeds for every row (bench.md).

Rows: ``ar`` (the plain sampler), ``ar-reseeded`` (the plain sampler at other seeds: the Frechet distance two plain
runs are apart, the floor the others are read against), ``fastvar`` (the release's schedule from the end: prune
0.4 and 0.5, skip the last two), ``fastvar-prune`` (the same pruning, every scale kept), ``fastvar-0.25`` (a
quarter of the last scale's tokens pruned, nothing skipped), ``skip-1``, ``skip-2``
(SkipVAR's step skipping), ``uncond-1``, ``uncond-2`` (its unconditional-branch replacement). Per row: class
accuracy and Frechet distances in the demo classifier's features (to real images and to ``ar``), the tokens each
image's sub-layers forwarded (mean over blocks and sub-layers, summed over the scales, per guidance row) and the
share of the plain sampler's transformer FLOPs, both counted by the sampler; a rough batch-1 time per image.
"""
from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from ...errors import FastARError
from ...model_loaders.shared.demo import DEMO_VAR, demo_image_decoder
from ...pipeline import class_conditioning, load_models
from ...samplers.decoders import NEXT_SCALE, decode_next_scale
from ...samplers.few_step_loops.next_scale import VAR_SAMPLING
from ...samplers.few_step_loops.scale_acceleration import FASTVAR, ScaleAcceleration
from ...settings import sampling_from
from .common import CHUNK, frechet_against, latency_note, quality, real_features

ROWS = {
    "ar": None,
    "ar-reseeded": None,
    "fastvar": FASTVAR,
    "fastvar-prune": ScaleAcceleration(prune_ratios=FASTVAR.prune_ratios),
    "fastvar-0.25": ScaleAcceleration(prune_ratios=(0.25,)),
    "skip-1": ScaleAcceleration(skip_last=1),
    "skip-2": ScaleAcceleration(skip_last=2),
    "uncond-1": ScaleAcceleration(uncond_last=1),
    "uncond-2": ScaleAcceleration(uncond_last=2),
}
RESEEDED = 100_000  # the reseeded row's seed offset


def forwarded(stats) -> tuple[float, float]:
    """Tokens forwarded per image row (summed over the scales) and the share of transformer FLOPs."""
    accel = stats.settings.get("scale_acceleration")
    if accel is None:
        return float(stats.tokens), 1.0
    return float(sum(accel["forwarded_tokens"])), accel["flops_share"]


def run_var_bench(args) -> dict:
    from .classifier import load_classifier
    from .demo_data import MAR_TOKEN

    started = time.perf_counter()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model_path = args.model or str(DEMO_VAR)
    models = load_models(model_path, args.vq or demo_image_decoder(model_path), args.device, args.dtype,
                         weights=args.weights)
    if models.ar.kind != NEXT_SCALE:
        raise FastARError(f"bench --var needs a VAR model as --model; {model_path} is {models.ar.what}")
    sampling = sampling_from(args, models.ar, VAR_SAMPLING)
    judge = load_classifier(device=models.ar.device)
    num_classes = models.ar.cfg.num_classes
    labels = [i % num_classes for i in range(args.samples)]
    reference_feats = real_features(judge, MAR_TOKEN)  # the demo VAR learnt the MAR demo's 16-pixel images

    def run(label, batch, seed):
        offset = RESEEDED if label == "ar-reseeded" else 0
        return decode_next_scale(models.ar, class_conditioning(models.ar, batch), sampling, seed=seed + offset,
                                 vqvae=models.vq, acceleration=ROWS[label])

    results = {}
    for label in ROWS:
        outputs, work = [], []
        for start in range(0, len(labels), CHUNK):
            f_hat, stats = run(label, labels[start : start + CHUNK], args.seed + start)
            outputs.append(f_hat.cpu())
            work.append(forwarded(stats))
        results[label] = {"forwards_per_image": stats.target_forwards,
                          "tokens_forwarded": float(np.mean([w[0] for w in work])),
                          "flops_share": float(np.mean([w[1] for w in work])),
                          "per_scale": stats.settings.get("scale_acceleration", {}).get("forwarded_tokens"),
                          **quality(models, judge, torch.cat(outputs), labels, reference_feats)}
        print(f"[bench] {label}: class accuracy {100 * results[label]['class_accuracy']:.1f}%", flush=True)
    frechet_against(results, "ar")

    times = {label: [] for label in ROWS}
    for label in ROWS:  # warm-up
        run(label, [0], args.seed)
    for r in range(args.timing_runs):
        for label in ROWS:
            times[label].append(run(label, [r % num_classes], args.seed + 1000 + r)[1].wall_time_s)
    for label, r in results.items():
        r["median_time_s"] = statistics.median(times[label])
        r["latency_ratio"] = statistics.median(times["ar"]) / r["median_time_s"]

    report = {"model": Path(model_path).name, "patch_nums": list(models.ar.cfg.patch_nums),
              "depth": models.ar.cfg.depth, "cfg": sampling.cfg_scale, "top_k": sampling.top_k,
              "top_p": sampling.top_p, "device": str(models.ar.device),
              "machine": f"{platform.machine()}, {torch.get_num_threads()} threads", "samples": args.samples,
              "results": results, "bench_time_s": round(time.perf_counter() - started)}
    (out_dir / "bench_var.json").write_text(json.dumps(report, indent=1))
    (out_dir / "bench_var.md").write_text(markdown(report))
    print((out_dir / "bench_var.md").read_text())
    return report


def markdown(report: dict) -> str:
    lines = [f"# FastAR VAR acceleration benchmark ({report['model']}, scales {report['patch_nums']}, depth "
             f"{report['depth']}, {report['device']}, {report['samples']} samples per row, cfg {report['cfg']}, "
             f"top-k {report['top_k']}, top-p {report['top_p']})", "",
             "| row | forwards | tokens forwarded / image | transformer FLOPs | class accuracy | Frechet (real) | "
             "Frechet (vs ar) | latency ratio (rough) |",
             "|---|---|---|---|---|---|---|---|"]
    for label, r in report["results"].items():
        lines.append(f"| {label} | {r['forwards_per_image']} | {r['tokens_forwarded']:.1f} | "
                     f"{100 * r['flops_share']:.0f}% | {100 * r['class_accuracy']:.1f}% | {r['frechet']:.2f} | "
                     f"{r['frechet_vs_ar']:.2f} | {r['latency_ratio']:.2f}x |")
    lines += ["", "Tokens forwarded: per image and guidance row, the mean over blocks and sub-layers, summed over the "
              "scales; FLOPs: the blocks' matmuls and attention, as a share of the plain sampler's (both counted by "
              "the sampler). " + latency_note(report)]
    return "\n".join(lines) + "\n"
