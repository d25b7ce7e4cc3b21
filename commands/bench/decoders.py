"""``python -m fastar bench``: decoders side by side on one model, same classes and seeds (bench.md).

Measures, per decoder: step compression (an image's tokens over its own forwards, row_step_compression pooled over
the samples), tokens per forward while an image runs (tokens_per_forward: docs/statistics.md), the share of iterations that kept their first draft, latency ratio against plain AR
(batch 1 with CFG, interleaved runs, medians, VQ decode excluded), class accuracy and a Frechet distance in the demo classifier's feature space
(against real procedural images and against plain AR's samples), the window cost c(W), slider
sweeps for the Pareto plot, and the total-variation distance of relaxed decoders on the toy model; per model,
how ambiguous its next token is (ambiguity.py).
"""
from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ...settings import sampling_from, spec_from
from ...errors import FastARError
from ...model_loaders.drafters.small_ar import SmallARDrafter
from ...model_loaders.shared.compiled import compiled_mode
from ...model_loaders.shared.demo import DEMO_AR, demo_drafter
from ...model_loaders.shared.quantized import weight_format
from ...model_loaders.shared.protocol import ClassConditioning, PromptConditioning
from ...pipeline import class_conditioning, conditioning_type, load_models
from ...samplers.decoders import DECODERS, DRAFTED_BY_DEFAULT, LOSSLESS, WINDOWED, WITH_DRAFTER, DecoderSpec, decode
from ...samplers.processing import SamplingSettings
from ...samplers.token_loops.zipar import zipar_feeds
from ...speed_dial import (FLAT_COST, GPU_PRICING, SPEEDS, TOKEN_CANDIDATES, Choice, WindowPricing, pick,
                           window_costs)
from .ambiguity import first_draft_acceptance, next_token_ambiguity
from .common import CHUNK, frechet_against, quality, quality_panels, real_features, require_matplotlib, save_panels

WINDOW_COSTS = (1, 2, 4, 8, 16, 32)
SWEEP_GROUPS = (1, 3, 10, 25, 50, 100)
SWEEP_WINDOWS = (4, 8, 16, 32)
SWEEP_DELTAS = (0.0, 0.05, 0.1, 0.2, 0.4, 0.7)
SWEEP_KS = (1, 4, 16, 64, 256, 1000)
SWEEP_K_DELTA = 0.2
SWEEP_LEADS = (1, 2, 4, 8)
ROW_PARALLEL = ("zipar", "zipar-sjd")  # several rows per iteration: "kept its first draft" means nothing there
RELAXED = tuple(d for d in DECODERS if not LOSSLESS[d])  # their distance to the exact target is measured on the toy
TOY_DELTAS = (0.0, 0.05, 0.1, 0.2, 0.4)
TOY_STRENGTHS = (0.0, 0.5, 1.0)


SWEEP_LAMBDAS = (1.0, 1.5, 2.0, 3.0, 5.0)
SWEEP_TREE_NODES = (8, 16, 32, 58)
SWEEP_PAC_WINDOWS = (16, 32, 64)  # SJD-PAC's tree takes part of the window: the smallest hold it and little more
SWEEP_PAC_BRANCHES = (1, 2, 3, 4)
SWEEP_ENTROPY_STRENGTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
SWEEP_PAC_BRANCH_WINDOW = 32  # holds 4 branches 3 deep
LANTERN_PP_LAMBDA = 3.0  # the lantern++ row's lambda without --lantern-lambda (the demo's sweep: benchmark.md)
MODIFIERS = ("jacobi", "drafter", "top", "tree")


@dataclass(frozen=True)
class Entry:
    """One benchmarked decoder: a label, its spec, and whether it drafts with the drafter model.
    ``NAME-jacobi`` drafts Jacobi windows, ``NAME-drafter`` chains from the drafter, ``NAME-top`` chains the
    drafter's most likely codes, ``-tree`` drafts trees instead of chains (static unless --tree dynamic, e.g.
    spec-top-tree); a bare name uses the drafter when the decoder needs one or is LANTERN. ``lantern++`` is
    LANTERN++: a static tree with the multiplicative bound lambda."""

    label: str
    spec: DecoderSpec
    drafted: bool


def row_spec(args, name: str) -> DecoderSpec:
    """A row's decoder settings; drafts are sampled unless the row is named ``NAME-top``."""
    if args.drafts != "sampled":
        raise FastARError(f"the benchmark names its rows with {args.drafts} drafts: give --decoders with "
                          f"NAME-{args.drafts} rows (e.g. spec,spec-{args.drafts}) instead of --drafts")
    return spec_from(args, name)


def parse_entries(text: str, args) -> dict[str, Entry]:
    entries = {}
    for label in (item.strip() for item in text.split(",")):
        if not label:
            continue
        name, *modifiers = (label,) if label in DECODERS else ("lantern", "tree") if label == "lantern++" else \
            label.split("-")
        if name not in DECODERS or not set(modifiers) <= set(MODIFIERS) or ("jacobi" in modifiers and
                                                                            len(modifiers) > 1):
            raise FastARError(f"unknown bench decoder '{label}': use one of {', '.join(DECODERS)}, optionally "
                              "with -jacobi, -drafter or -top (the drafter's most likely code as its draft) and "
                              "-tree (trees instead of chains), or lantern++; e.g. lantern-jacobi, spec-top-tree")
        drafted = "jacobi" not in modifiers and (bool(modifiers) or name in DRAFTED_BY_DEFAULT)
        if drafted and name not in WITH_DRAFTER:
            raise FastARError(f"'{label}': the {name} decoder does not use a drafter")
        spec = row_spec(args, name)
        if "top" in modifiers:
            spec = replace(spec, drafts="top")
        if "tree" in modifiers:
            spec = replace(spec, tree="static" if spec.tree == "chain" else spec.tree)
        if label == "lantern++":
            spec = replace(spec, lantern_lambda=spec.lantern_lambda or LANTERN_PP_LAMBDA)
        entries[label] = Entry(label, spec, drafted)
    if "ar" not in entries:  # every ratio is against plain AR, measured in the same run
        entries = {"ar": Entry("ar", row_spec(args, "ar"), False), **entries}
    return entries


def demo_rows(model, labels: list[int], first: int = 0):
    """Conditioning for the demo classes ``labels``: the labels themselves for a class model; for a model that
    reads prompts (the text demo), their captions, the colours varying with the sample's index ``first + i``."""
    if conditioning_type(model) != "prompt":
        return class_conditioning(model, labels)
    from .demo_data import caption

    bits = [[(i * 3 >> b) & 1 for b in (2, 1, 0)] for i in range(first, first + len(labels))]
    return PromptConditioning([caption(label, b) for label, b in zip(labels, bits)])


def demo_classes(model) -> int:
    """How many demo classes the model draws (its classes, or the text demo's shapes)."""
    from .demo_data import CLASS_NAMES

    return model.cfg.num_classes if conditioning_type(model) == "c2i" else len(CLASS_NAMES)


def run_decoder(models, cond, sampling, entry: Entry, seed: int):
    return decode(models.ar, cond, sampling, entry.spec, seed=seed, codebook=models.codebook(),
                  drafter=models.drafter if entry.drafted else None)


def sample_many(models, sampling, entry: Entry, labels: list[int], seed: int):
    """Codes for every label (batched in chunks, one seed per chunk), per-row forward counts, accepted
    run lengths and drafter forwards."""
    codes, row_forwards, accepted, drafter_forwards = [], [], [], 0
    for start in range(0, len(labels), CHUNK):
        cond = demo_rows(models.ar, labels[start : start + CHUNK], start)
        out, stats = run_decoder(models, cond, sampling, entry, seed + start)
        codes.append(out.cpu())
        row_forwards += stats.row_forwards
        accepted += [c for it in stats.fixed_per_forward for c in it if c > 0]
        drafter_forwards += stats.drafter_forwards
    return torch.cat(codes), row_forwards, accepted, drafter_forwards


def ambiguity_along(models, sampling, codes: torch.Tensor, labels: list[int]) -> dict:
    """The target's next-token ambiguity along its own samples ``codes``, averaged over them."""
    per_sample = {"top1_probability": [], "entropy_nats": []}
    for start in range(0, len(labels), CHUNK):
        cond = demo_rows(models.ar, labels[start : start + CHUNK], start)
        for key, values in next_token_ambiguity(models.ar, cond, sampling, codes[start : start + CHUNK]).items():
            per_sample[key] += values
    return {key: float(np.mean(values)) for key, values in per_sample.items()} | {"samples": len(labels)}


def speed(row_forwards: list[int], accepted: list[int], num_tokens: int) -> dict:
    return {
        "step_compression": num_tokens * len(row_forwards) / sum(row_forwards),
        "tokens_per_forward": float(np.mean(accepted)),
        "first_draft_acceptance": first_draft_acceptance(accepted),
        "accepted_histogram": np.bincount(accepted).tolist(),
    }


def timed_runs(models, sampling, entries: dict[str, Entry], runs: int, num_classes: int, seed: int) -> dict:
    """Batch-1 wall times (drafter included) and the drafter's share, interleaved A B C A B C ... so
    drift hits every decoder alike. Medians per decoder."""
    times = {name: [] for name in entries}
    drafter_share = {name: [] for name in entries}
    cond = demo_rows(models.ar, [0])
    for entry in entries.values():  # warm-up
        run_decoder(models, cond, sampling, entry, seed)
    for r in range(runs):
        cond = demo_rows(models.ar, [r % num_classes], r)
        for name, entry in entries.items():
            _, stats = run_decoder(models, cond, sampling, entry, seed + 1000 + r)
            times[name].append(stats.decode_time_s)
            drafter_share[name].append(stats.drafter_time_s / stats.wall_time_s)
    return {name: {"median_time_s": statistics.median(times[name]),
                   "drafter_time_share": statistics.median(drafter_share[name])} for name in entries}


def bench_window_costs(model, cfg: bool, repeats: int = 20) -> dict:
    """c(W): time of one forward over W tokens / time of a single-token forward (cache half full)."""
    costs = window_costs(model, demo_rows(model, [0]), WINDOW_COSTS, repeats=repeats, cfg=cfg)
    return {str(w): c for w, c in costs.items()}


def toy_total_variation(base: DecoderSpec, rows: int = 20000) -> dict:
    """Measured TV distance to the exact target on enumerable toys for GSD per group size, LANTERN per delta (with a
    drafter toy and on Jacobi drafts) and SJD's entropy-aware acceptance per strength (6 codes, 3 tokens), and for
    ZipAR per lead (4 codes, 2 rows of 3: a lead of 3 is plain AR). The exact settings' TV (G=1, delta=0, strength 0,
    lead 3) is the sampling-noise floor."""
    from .toy_model import ToyModel

    toy = ToyModel(vocab=6, grid=(1, 3), num_classes=1, scale=1.5, seed=0)
    rows_toy = ToyModel(vocab=4, grid=(2, 3), num_classes=1, scale=1.5, seed=2)
    drafter = SmallARDrafter(ToyModel(vocab=6, grid=(1, 3), num_classes=1, scale=1.5, seed=1))
    sampling = SamplingSettings(cfg_scale=2.0)
    cond = ClassConditioning(torch.zeros(rows, dtype=torch.long))

    def tv(spec, with_drafter=False, seed=0, model=toy):
        codes, _ = decode(model, cond, sampling, spec, seed=seed, drafter=drafter if with_drafter else None,
                          codebook=model.code_embeddings())
        exact = model.exact_joint(0, cfg_scale=2.0)
        empirical = torch.bincount(model.index_of(codes), minlength=len(exact)).double() / rows
        return float(0.5 * (empirical - exact).abs().sum())

    jacobi = replace(base, window=3, init="random")
    lantern = replace(jacobi, decoder="lantern", gamma=2)
    return {
        "rows": rows,
        "gsd_by_group": {str(g): tv(replace(jacobi, decoder="gsd", group=g), seed=g) for g in (1, 3, 5)},
        "lantern_drafter_by_delta": {str(d): tv(replace(lantern, lantern_delta=d), True, seed=10) for d in TOY_DELTAS},
        "lantern_jacobi_by_delta": {str(d): tv(replace(lantern, lantern_delta=d), seed=20) for d in TOY_DELTAS},
        "sjd_entropy_by_strength": {str(s): tv(replace(jacobi, decoder="sjd-entropy", entropy_strength=s), seed=40)
                                    for s in TOY_STRENGTHS},
        "zipar_by_lead": {str(lead): tv(replace(jacobi, decoder="zipar", zipar_lead=lead), seed=30 + lead, model=rows_toy)
                          for lead in (1, 2, 3)},
    }



def sweep_configs(base: DecoderSpec, entries: dict[str, Entry], drafted: bool) -> list[tuple[str, str, DecoderSpec, bool]]:
    """The slider sweeps of the benchmarked decoders: GSD's group size, SJD's and SJD-PAC's window and coupling (and
    SJD-PAC's branches), the entropy-aware acceptance's strength, LANTERN's delta and k (with the drafter when there is one), LANTERN++'s lambda and a dynamic
    tree's size (with trees).
    Each config names its series and slider."""
    configs, decoders = [], {entry.spec.decoder for entry in entries.values()}
    if "gsd" in decoders:
        configs += [("GSD (group size)", "group", replace(base, decoder="gsd", group=g), False) for g in SWEEP_GROUPS]
    if "sjd" in decoders:
        configs += [(f"SJD {c} (window)", "window", replace(base, decoder="sjd", window=w, coupling=c), False)
                    for c in ("independent", "maximal") for w in SWEEP_WINDOWS]
    if "sjd-pac" in decoders:
        configs += [(f"SJD-PAC {c}, {base.pac_branches} branches (window)", "window",
                     replace(base, decoder="sjd-pac", window=w, coupling=c), False)
                    for c in ("independent", "maximal") for w in SWEEP_PAC_WINDOWS]
        configs += [(f"SJD-PAC maximal, window {SWEEP_PAC_BRANCH_WINDOW} (branches)", "pac_branches",
                     replace(base, decoder="sjd-pac", window=SWEEP_PAC_BRANCH_WINDOW, coupling="maximal",
                             pac_branches=b), False)
                    for b in SWEEP_PAC_BRANCHES]
    if "sjd-entropy" in decoders:
        configs += [(f"SJD entropy-aware, {base.coupling}, window {base.window} (strength)", "entropy_strength",
                     replace(base, decoder="sjd-entropy", entropy_strength=s), False) for s in SWEEP_ENTROPY_STRENGTHS]
    for name, series in (("zipar", "ZipAR (lead)"), ("zipar-sjd", f"ZipAR+SJD {base.window} (lead)")):
        if name in decoders:
            configs += [(series, "zipar_lead", replace(base, decoder=name, zipar_lead=lead), False) for lead in SWEEP_LEADS]
    if "lantern" in decoders:
        configs += [("LANTERN (delta)", "lantern_delta", replace(base, decoder="lantern", lantern_delta=d), drafted)
                    for d in SWEEP_DELTAS]
        configs += [(f"LANTERN (k, delta={SWEEP_K_DELTA})", "lantern_k",
                     replace(base, decoder="lantern", lantern_delta=SWEEP_K_DELTA, lantern_k=k), drafted)
                    for k in SWEEP_KS]
    if "lantern++" in entries and drafted:
        configs += [("LANTERN++ (lambda)", "lantern_lambda",
                     replace(base, decoder="lantern", tree="static", lantern_lambda=lam), True) for lam in SWEEP_LAMBDAS]
    if drafted and any(entry.spec.tree != "chain" for entry in entries.values()):
        configs += [("spec, top-drafted dynamic tree (nodes)", "tree_nodes",
                     replace(base, decoder="spec", drafts="top", tree="dynamic", tree_nodes=nodes), True)
                    for nodes in SWEEP_TREE_NODES]
    return configs


def sweep(models, judge, sampling, configs, labels, seed, reference_feats) -> list[dict]:
    """Speed/quality points of the sweep configs, with a progress line per point."""
    points = []
    for i, (series, slider, spec, with_drafter) in enumerate(configs, 1):
        started = time.perf_counter()
        codes, forwards, accepted, _ = sample_many(models, sampling, Entry(series, spec, with_drafter), labels, seed)
        q = quality(models, judge, codes, labels, reference_feats)
        q.pop("_feats")
        point = {"series": series, "slider": slider, "value": spec.as_dict()[slider], "spec": spec.as_dict(),
                 "drafter": with_drafter, **speed(forwards, accepted, codes.shape[1]), **q}
        points.append(point)
        print(f"[bench] sweep {i}/{len(configs)} {sweep_label(point)}: {point['step_compression']:.2f}x, "
              f"class accuracy {100 * point['class_accuracy']:.1f}% ({time.perf_counter() - started:.0f} s)",
              flush=True)
    return points


def dial_entries() -> dict[str, Entry]:
    """The speed dial's candidates for token models (speed_dial.py), plain AR first."""
    return {c.label: Entry(c.label, Choice("", c, "").spec(), c.drafter) for c in TOKEN_CANDIDATES}


def dial_report(results: dict, window_cost: dict, grid: tuple[int, int]) -> dict:
    """The candidates as this run measured them, and each level's pick by the dial's rule on a GPU and on this
    machine's CPU (its window costs as measured here). Candidates that sample one distribution (plain AR and every
    lossless one; ZipAR with or without drafts at one lead) share one quality, the mean of theirs: one run's class
    accuracy is several points off by chance, which the levels' bounds must not see. (Each Frechet distance is
    measured on one run's samples: it shrinks with more samples, so only like counts compare.)"""
    by_distribution: dict[str, list[str]] = {}
    for c in TOKEN_CANDIDATES:
        by_distribution.setdefault(c.distribution, []).append(c.label)
    pooled = {label: tuple(float(np.mean([results[n][key] for n in names])) for key in ("class_accuracy", "frechet"))
              for names in by_distribution.values() for label in names}
    measured = [replace(c, width=forward_width(c, grid), steps=round(r["step_compression"], 2),
                        accuracy=round(100 * pooled[c.label][0], 1), frechet=round(pooled[c.label][1], 2),
                        cpu_speedup=round(r["latency_ratio"], 2))
                for c, r in zip(TOKEN_CANDIDATES, results.values())]
    here = WindowPricing({int(w): c for w, c in window_cost.items()}, flat=window_cost["16"] <= FLAT_COST)
    picks = {f"{speed}, {where}{', drafter' if drafter else ''}":
             pick([c for c in measured if drafter or not c.drafter], speed, pricing, device).candidate.label
             for speed in SPEEDS for drafter in (False, True)
             for where, pricing, device in (("GPU", GPU_PRICING, "cuda"), ("this CPU", here, "cpu"))}
    return {"candidates": [asdict(c) for c in measured], "picks": picks}


def forward_width(candidate, grid: tuple[int, int]) -> int:
    """The most tokens a forward of ``candidate`` feeds per image (what a window's cost depends on)."""
    spec = Choice("", candidate, "").spec()
    if spec.decoder in ("zipar", "zipar-sjd"):
        return zipar_feeds(grid, spec.zipar_lead, spec.window if spec.decoder == "zipar-sjd" else 1)
    if candidate.drafter:
        return spec.tree_settings().width
    return spec.window if spec.decoder in WINDOWED else 1


def run_bench(args) -> dict:
    from .classifier import load_classifier

    started = time.perf_counter()
    entries = dial_entries() if args.dial else parse_entries(args.decoders, args)
    if not args.no_pareto:
        require_matplotlib()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    bundled = demo_drafter(args.model or DEMO_AR)  # a bundled model drafts with its bundled drafter
    drafter_path = args.drafter or (str(bundled) if bundled else None)
    models = load_models(args.model, args.vq, args.device, args.dtype, drafter_path=drafter_path,
                         image_size=args.image_size, compile_switch=args.compile, gpu_weights=args.gpu_weights,
                         weights=args.weights)
    if models.vq is None:
        raise FastARError("the benchmark decodes images: give --vq with --model")
    if models.drafter is None and any(e.drafted for e in entries.values()):
        raise FastARError("some benchmarked decoders draft with a drafter: give --drafter, or bench them "
                          "with Jacobi drafts (e.g. lantern-jacobi)")
    sampling = sampling_from(args)
    judge = load_classifier(device=models.ar.device)
    num_classes = demo_classes(models.ar)
    labels = [i % num_classes for i in range(args.samples)]
    reference_feats = real_features(judge)
    num_tokens = models.ar.grid[0] * models.ar.grid[1]

    results = {}
    for name, entry in entries.items():
        print(f"[bench] {name}: {args.samples} samples", flush=True)
        entry_started = time.perf_counter()
        codes, forwards, accepted, drafter_forwards = sample_many(models, sampling, entry, labels, args.seed)
        if name == "ar":
            ambiguity = ambiguity_along(models, sampling, codes, labels)
        results[name] = {"lossless": LOSSLESS[entry.spec.decoder], "spec": entry.spec.as_dict(),
                         "drafter": models.drafter.name if entry.drafted else None,
                         "drafter_forwards_per_image": drafter_forwards / len(labels),
                         **speed(forwards, accepted, num_tokens),
                         **quality(models, judge, codes, labels, reference_feats)}
        print(f"[bench] {name}: {results[name]['step_compression']:.2f}x step compression, class accuracy "
              f"{100 * results[name]['class_accuracy']:.1f}% ({time.perf_counter() - entry_started:.0f} s)", flush=True)
    frechet_against(results, "ar")

    print(f"[bench] latency: {args.timing_runs} interleaved batch-1 runs per decoder", flush=True)
    timings = timed_runs(models, sampling, entries, args.timing_runs, num_classes, args.seed)
    for name, r in results.items():
        r.update(timings[name])
        r["latency_ratio"] = timings["ar"]["median_time_s"] / timings[name]["median_time_s"]

    report = {
        "model": str(args.model or "bundled demo model"),
        "device": str(models.ar.device),
        "dtype": str(models.ar.dtype).replace("torch.", ""),
        "compiled": compiled_mode(models.ar),
        "weights": weight_format(models.ar),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "samples": args.samples,
        "sampling": asdict(sampling),
        "results": results,
        "ambiguity": ambiguity,
        "window_cost": bench_window_costs(models.ar, sampling.use_cfg),
    }
    if args.dial:
        report["dial"] = dial_report(results, report["window_cost"], models.ar.grid)
    decoders = {entry.spec.decoder for entry in entries.values()}
    if decoders & set(RELAXED) and not args.dial:
        print("[bench] toy total-variation distance of the relaxed decoders", flush=True)
        report["toy_tv"] = toy_total_variation(row_spec(args, "sjd"), args.toy_rows)
    configs = [] if args.no_pareto or args.dial else sweep_configs(row_spec(args, "sjd"), entries,
                                                                   models.drafter is not None)
    if configs:
        write_report(report, out_dir, started)  # the rows kept should the sweeps be cut short
        sweep_labels = labels[: args.sweep_samples or max(num_classes, args.samples // 2)]
        print(f"[bench] slider sweeps for the Pareto plot: {len(configs)} points x {len(sweep_labels)} samples",
              flush=True)
        report["pareto"] = sweep(models, judge, sampling, configs, sweep_labels, args.seed, reference_feats)
        plot_pareto(report["pareto"], results, out_dir / "pareto.png")
    write_report(report, out_dir, started)
    print((out_dir / "bench.md").read_text())
    return report


def write_report(report: dict, out_dir: Path, started: float) -> None:
    report["bench_time_s"] = round(time.perf_counter() - started)
    (out_dir / "bench.json").write_text(json.dumps(report, indent=1))
    (out_dir / "bench.md").write_text(markdown(report))


def markdown(report: dict) -> str:
    lines = [
        f"# FastAR benchmark ({report['model']}, {report['device']}, {report['dtype']}"
        + (f", compiled steps ({report['compiled']})" if report.get("compiled") else "")
        + (f", {report['weights']} weights" if report.get("weights", "auto") != "auto" else "")
        + f", {report['samples']} samples per decoder)",
        "",
        "| decoder | lossless | drafter | step compression | tokens per forward | first draft kept | drafter forwards / "
        "image | latency ratio | drafter share of time | class accuracy | Frechet (real) | Frechet (vs AR) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["results"].items():
        drafts = name != "ar" and r["spec"]["decoder"] not in ROW_PARALLEL
        kept = f"{100 * r['first_draft_acceptance']:.1f}%" if drafts else "-"
        lines.append(
            f"| {name} | {'yes' if r['lossless'] else 'no'} | {r['drafter'] or '-'} | {r['step_compression']:.2f}x | "
            f"{r['tokens_per_forward']:.2f} | {kept} | {r['drafter_forwards_per_image']:.0f} | {r['latency_ratio']:.2f}x | "
            f"{100 * r['drafter_time_share']:.0f}% | {100 * r['class_accuracy']:.1f}% | {r['frechet']:.2f} | "
            f"{r['frechet_vs_ar']:.2f} |"
        )
    ambiguity = report["ambiguity"]
    lines += ["", f"Next-token ambiguity of the model along plain AR's {ambiguity['samples']} samples (the distribution "
                  f"the decoders sample from): mean top-1 probability {ambiguity['top1_probability']:.3f}, mean "
                  f"entropy {ambiguity['entropy_nats']:.2f} nats."]
    costs = ", ".join(f"c({w})={c:.2f}" for w, c in report["window_cost"].items())
    lines += ["", f"Window cost on {report['device']} ({report['machine']}): {costs}. "
                  f"The benchmark took {report['bench_time_s'] / 60:.1f} min."]
    if "toy_tv" in report:
        tv = report["toy_tv"]
        lines += ["", f"Total-variation distance to the exact target on the enumerable toys ({tv['rows']} rows; the "
                      "exact settings G=1, delta=0, strength 0 and lead 3 show the sampling-noise floor):", ""]
        for key, title in (("gsd_by_group", "GSD, group G"),
                           ("lantern_drafter_by_delta", "LANTERN with a drafter, delta"),
                           ("lantern_jacobi_by_delta", "LANTERN on Jacobi drafts, delta"),
                           ("sjd_entropy_by_strength", "SJD with entropy-aware acceptance, strength"),
                           ("zipar_by_lead", "ZipAR (2 rows of 3), lead")):
            lines.append(f"- {title}: " + ", ".join(f"{k}: {v:.4f}" for k, v in tv[key].items()))
    if "dial" in report:
        lines += dial_markdown(report["dial"])
    if "pareto" in report:
        lines += ["", "| sweep point | step compression | tokens per forward | class accuracy | Frechet (real) |",
                  "|---|---|---|---|---|"]
        for p in report["pareto"]:
            lines.append(f"| {sweep_label(p)} | {p['step_compression']:.2f}x | {p['tokens_per_forward']:.2f} | "
                         f"{100 * p['class_accuracy']:.1f}% | {p['frechet']:.2f} |")
    return "\n".join(lines) + "\n"


def dial_markdown(dial: dict) -> list[str]:
    lines = ["", "The speed dial's candidates as measured here (speed_dial.py carries them; width: the most tokens a "
                 "forward feeds per image; candidates of one distribution share its quality, the mean of their runs'):",
                 "", "| candidate | width | step compression | class accuracy | "
                 "Frechet (real) | latency ratio (CPU) |", "|---|---|---|---|---|---|"]
    lines += [f"| {c['label']} | {c['width']} | {c['steps']:.2f}x | {c['accuracy']:.1f}% | {c['frechet']:.2f} | "
              f"{c['cpu_speedup']:.2f}x |" for c in dial["candidates"]]
    lines += ["", "The dial's picks from these numbers:", ""]
    lines += [f"- {level}: {label}" for level, label in dial["picks"].items()]
    return lines


def sweep_label(point: dict) -> str:
    source = " with the drafter" if point["drafter"] else ""
    return f"{point['series']}{source}: {point['slider']}={point['value']}"


def plot_pareto(points: list[dict], results: dict, path: Path) -> None:
    fig, axes = quality_panels()
    series: dict[str, list[dict]] = {}
    for point in points:
        series.setdefault(point["series"], []).append(point)
    for ax, metric, title in ((axes[0], "class_accuracy", "class accuracy"), (axes[1], "frechet", "Frechet distance (lower is better)")):
        for label, pts in series.items():
            xs = [p["step_compression"] for p in pts]
            ys = [p[metric] for p in pts]
            ax.plot(xs, ys, "o-", label=label)
            for p, x, y in zip(pts, xs, ys):
                ax.annotate(str(p["value"]), (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7)
        ar = results["ar"]
        ax.plot([ar["step_compression"]], [ar[metric]], "k*", markersize=10, label="plain AR")
        ax.set_xlabel("step compression (tokens per target forward)")
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
    save_panels(fig, axes, "FastAR speed/quality trade-off on the demo model", path)
