"""The GPU check (issue 31): one script, one report, under 10 minutes on one GPU.

    python -m fastar.commands.gpu_check --out out/gpu_check [--budget 480] [--device cuda]

What it runs, each step a ``python -m fastar ...`` subprocess (a device assert in one must not end the rest):
- greedy codes on the GPU in fp32 against the CPU's, per bundled demo family, at settings where greedy is not
  degenerate (several classes or prompts, CFG >= 2); lossless decoders (sjd, spec) against ``ar`` on the GPU;
- the conformance fixtures (tests/conformance) on the GPU in fp32 against the official samplers' codes;
- compiled steps against eager ones on the GPU (the proof ``--compile auto`` needs before it turns on for CUDA):
  ar and sjd, ZipAR's feeds anywhere and VAR's scales; MAR's compiled steps, whose latents must come close to eager's;
- bf16 and fp16 runs of every demo family and decoder, their images side by side in ``precision.png``;
- 8-bit blocks (int8, fp8): compiled steps against eager ones (issue 35), and a 7B shape's compiled int8 step against
  its bf16 one;
- host syncs per decoder (``torch.cuda.set_sync_debug_mode``), the peak memory of a 7B shape with CFG, the fused
  8-bit matmul against the dequantised product and timed beside bf16, and inductor's own 8-bit product beside it
  (``--probe``, in-process: gpu_probes.py);
- the speed profile of LlamaGen-XL and a 7B shape against the bandwidth floor (``python -m fastar profile``), eager,
  compiled as CUDA graphs, and the 7B step under inductor's max-autotune too.
Steps run a few at a time (correctness) and the profiles alone at the end (timing); a step that would start
after ``--budget`` seconds is reported as skipped (correctness steps 200 s earlier when timed steps were chosen). Writes ``report.json``, ``report.md`` and ``precision.png``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from .gpu_probes import PROBES

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "demo"
FIXTURES = ROOT / "tests" / "conformance" / "fixtures"
PROMPTS = ["--prompt", "a red ring on a cyan background", "--prompt", "a blue square on a yellow background"]
GREEDY = ["--top-k", "1"]
COMPILED_CHECKS = ("ar", "sjd", "zipar")  # compiled against eager: a session's forward, and ZipAR's forward_at
LOSSLESS_CHECKS = ("sjd", "spec")  # greedy, they equal ar's greedy codes
# MAR's latents through compiled reverse steps against eager ones: the median difference relative to the mean latent.
# Fused kernels round apart and the first reverse steps multiply eps by up to 20,000, so now and then a token lands in
# another mode and the later tokens of its image follow it: where that happens depends on the CPU's kernels (the
# demo's seed 1 on one CPU: 1 image of 4 went elsewhere, its latents 10% apart, the mean 2.4%). The median stays
# with the tokens that did not fork: 1e-5 to 4e-5 on the CPU, where a 2% temperature or 5% cfg slip in the compiled
# step moves it 1-3%, and the next reverse step's constants 30%.
LATENTS_CLOSE = 1e-3


@dataclass(frozen=True)
class Family:
    """A bundled demo model as the command line takes it, and the decoders that apply to it."""

    name: str
    model: list  # --model / --vq arguments
    condition: list  # what to draw, with CFG
    decoders: tuple = ("ar", "sjd")
    greedy: bool = True  # sampled discrete codes, so greedy is defined (not MAR's latents, not a DD student's map)
    compiles: bool = True  # --compile applies (static-cache steps: token models' and VAR's scales)
    latents_compile: bool = False  # --compile applies to MAR's steps: its latents are compared, not codes


FAMILIES = [
    Family("llamagen-c2i", ["--model", DEMO / "demo_c2i.safetensors", "--vq", DEMO / "demo_vq.safetensors"],
           ["--classes", "0,1,2,3", "--cfg", "2"], ("ar", "sjd", "gsd", "spec", "lantern", "zipar", "zipar-sjd")),
    Family("lumina-text", ["--model", DEMO / "demo_text", "--vq", DEMO / "demo_vqgan.safetensors"],
           [*PROMPTS, "--cfg", "3"], ("ar", "sjd", "gsd", "zipar")),
    Family("var", ["--model", DEMO / "demo_var.safetensors", "--vq", DEMO / "demo_var_vqvae.safetensors"],
           ["--classes", "0,1,2,3", "--cfg", "2"], ("ar",)),
    Family("var-dd", ["--model", DEMO / "demo_var_dd.safetensors", "--vq", DEMO / "demo_var_vqvae.safetensors"],
           ["--classes", "0,1,2,3"], ("dd",), greedy=False, compiles=False),
    Family("llamagen-dd", ["--model", DEMO / "demo_dd.safetensors", "--vq", DEMO / "demo_vq.safetensors"],
           ["--classes", "0,1,2,3"], ("dd",), greedy=False, compiles=False),
    Family("mar", ["--model", DEMO / "demo_mar.safetensors", "--vae", DEMO / "demo_kl_vae.safetensors"],
           ["--classes", "0,1,2,3", "--cfg", "3", "--num-iter", "16", "--diffusion-steps", "25"],
           ("ar", "cspd", "ar-reuse"), greedy=False, compiles=False, latents_compile=True),
]
DRAFTERS = {"spec": DEMO / "demo_drafter", "lantern": DEMO / "demo_drafter", "cspd": DEMO / "demo_mar_draft.safetensors"}
VARIANTS = {"ar-reuse": ["--decoder", "ar", "--reuse"]}  # a decoder with a switch (a step's name stays a plain file name)

# conformance fixture -> the arguments naming its model (the runs' own arguments are in its expected.json)
CONFORMANCE = {
    "llamagen_c2i": ["--model", FIXTURES / "llamagen_c2i" / "gpt.pt", "--vq", FIXTURES / "llamagen_c2i" / "vq.pt"],
    "llamagen_t2i": ["--model", FIXTURES / "llamagen_t2i" / "gpt.pt", "--vq", FIXTURES / "llamagen_c2i" / "vq.pt",
                     "--t5", FIXTURES / "llamagen_t2i" / "t5"],
    "anole": ["--model", FIXTURES / "anole", "--vq", FIXTURES / "chameleon_vqgan" / "vqgan.ckpt"],
    "lumina_mgpt": ["--model", FIXTURES / "lumina_mgpt", "--vq", FIXTURES / "chameleon_vqgan" / "vqgan.ckpt"],
    "janus_transformers": ["--model", FIXTURES / "janus_transformers"],
    "janus_deepseek": ["--model", FIXTURES / "janus_deepseek"],
    "var": ["--model", FIXTURES / "var" / "var_d2.pth", "--vq", FIXTURES / "var" / "vae_ch32v32z8.pth"],
    # LANTERN's drafters: greedy spec runs, the official EaModel.generate's codes
    "llamagen_lantern": ["--model", FIXTURES / "llamagen_lantern" / "gpt.pt",
                         "--drafter", FIXTURES / "llamagen_lantern" / "drafter"],
    "llamagen_t2i_lantern": ["--model", FIXTURES / "llamagen_t2i_lantern" / "LlamaGen-T2I", "--t5",
                             FIXTURES / "llamagen_t2i" / "t5", "--drafter", FIXTURES / "llamagen_t2i_lantern" / "drafter"],
    "anole_lantern": ["--model", FIXTURES / "anole", "--vq", FIXTURES / "chameleon_vqgan" / "vqgan.ckpt",
                      "--drafter", FIXTURES / "anole_lantern" / "drafter"],
}


@dataclass
class Step:
    """One subprocess of the check and what came of it."""

    name: str
    argv: list
    group: str
    compare: dict = field(default_factory=dict)  # what its codes must equal: {"step": name} or {"codes": [...]}
    image: str | None = None  # the PNG it writes, for the precision sheet
    timeout: int = 240
    env: dict = field(default_factory=dict)  # on top of the check's environment
    rc: int | None = None
    seconds: float | None = None
    tail: str = ""
    verdict: str = "skipped"
    notes: list = field(default_factory=list)  # lines of its output about CUDA graphs (skipped, re-recorded)


def fastar_argv(*args) -> list:
    return [sys.executable, "-m", "fastar", *map(str, args)]


def generate(name, group, family_args, extra, out: Path, *, device, dtype, compare=None, image=False, tokens=True,
             latents=False):
    png = out / "images" / f"{name}.png"
    args = ["generate", *family_args, *extra, "--device", device, "--dtype", dtype, "--quiet", "--out", png,
            "--stats-out", out / "stats" / f"{name}.json"]
    if tokens:
        args += ["--tokens-out", out / "tokens" / f"{name}.json"]
    if latents:
        args += ["--latents-out", latents_path(out, name)]
    return Step(name, fastar_argv(*args), group, compare or {}, str(png) if image else None)


def correctness_steps(out: Path, device: str) -> list[Step]:
    steps = []
    for fam in FAMILIES:
        first = fam.decoders[0]
        base = [*fam.model, *fam.condition]
        if fam.greedy:
            cpu = f"{fam.name}-{first}-greedy-cpu"
            steps.append(generate(cpu, "cpu-reference", base, [*GREEDY, "--decoder", first], out, device="cpu",
                                  dtype="fp32"))
            gpu = f"{fam.name}-{first}-greedy-gpu-fp32"
            steps.append(generate(gpu, "gpu-vs-cpu", base, [*GREEDY, "--decoder", first], out, device=device,
                                  dtype="fp32", compare={"step": cpu}))
            for decoder in fam.decoders[1:]:
                if decoder in LOSSLESS_CHECKS:
                    steps.append(generate(f"{fam.name}-{decoder}-greedy-gpu-fp32", "lossless-on-gpu", base,
                                          [*GREEDY, "--decoder", decoder, *drafter(decoder)], out, device=device,
                                          dtype="fp32", compare={"step": gpu}))
            for decoder in [d for d in fam.decoders if d in COMPILED_CHECKS] if fam.compiles else ():
                eager = gpu if decoder == first else f"{fam.name}-{decoder}-greedy-gpu-fp32"
                if decoder != first and decoder not in LOSSLESS_CHECKS:  # no step above ran it eagerly
                    steps.append(generate(eager, "compiled-vs-eager", base, [*GREEDY, "--decoder", decoder], out,
                                          device=device, dtype="fp32"))
                steps.append(generate(f"{fam.name}-{decoder}-greedy-gpu-compiled", "compiled-vs-eager", base,
                                      [*GREEDY, "--decoder", decoder, "--compile", "on"], out, device=device,
                                      dtype="fp32", compare={"step": eager}))
            if fam.compiles:  # 8-bit blocks: compiled steps (where dequantisation fuses) against eager ones, in fp32
                for fmt in ("int8", "fp8"):  # as compiled-vs-eager (bf16 kernels may round fused products apart)
                    eager8 = f"{fam.name}-{first}-greedy-gpu-{fmt}"
                    weights = [*GREEDY, "--decoder", first, "--weights", fmt]
                    steps.append(generate(eager8, "8-bit", base, weights, out, device=device, dtype="fp32"))
                    steps.append(generate(f"{eager8}-compiled", "8-bit", base, [*weights, "--compile", "on"], out,
                                          device=device, dtype="fp32", compare={"step": eager8}))
            steps.append(generate(f"{fam.name}-{first}-greedy-gpu-streamed", "streamed-vs-resident", base,
                                  [*GREEDY, "--decoder", first, "--gpu-weights", "0"], out, device=device,
                                  dtype="fp32", compare={"step": gpu}))  # every block from host memory
        for decoder in fam.decoders if fam.latents_compile else ():  # continuous latents: close, not equal
            eager = f"{fam.name}-{decoder}-gpu-eager"
            steps.append(generate(eager, "compiled-vs-eager", base, [*decoder_args(decoder), "--seed", "1"], out,
                                  device=device, dtype="fp32", tokens=False, latents=True))
            steps.append(generate(f"{fam.name}-{decoder}-gpu-compiled", "compiled-vs-eager", base,
                                  [*decoder_args(decoder), "--seed", "1", "--compile", "on"], out, device=device,
                                  dtype="fp32", tokens=False, latents=True, compare={"latents": eager}))
        for dtype in ("fp32", "bf16", "fp16"):
            for decoder in fam.decoders:
                steps.append(generate(f"{fam.name}-{decoder}-{dtype}", "half-precision", base,
                                      [*decoder_args(decoder), "--seed", "1"], out, device=device,
                                      dtype=dtype, image=True, tokens=fam.greedy))
    for case, model_args in CONFORMANCE.items():
        expected = json.loads((FIXTURES / case / "expected.json").read_text())
        for i, run in enumerate(expected["runs"]):
            steps.append(generate(f"conformance-{case}-{i}", "conformance-on-gpu", model_args, run["args"], out,
                                  device=device, dtype="fp32", compare={"codes": run["codes"]}))
    order = ("cpu-reference", "gpu-vs-cpu", "half-precision", "conformance-on-gpu", "compiled-vs-eager", "8-bit",
             "streamed-vs-resident", "lossless-on-gpu")  # the most telling first: a step past the budget is skipped
    return sorted(steps, key=lambda s: order.index(s.group))


def drafter(decoder: str) -> list:
    return ["--drafter", DRAFTERS[decoder]] if decoder in DRAFTERS else []


def decoder_args(decoder: str) -> list:
    return VARIANTS.get(decoder) or ["--decoder", decoder, *drafter(decoder)]


def probe_and_profile_steps(out: Path, device: str, llamagen_code: str | None = None) -> list[Step]:
    """The timed steps, the speed goals' first: a step past the budget is skipped."""
    probe = [sys.executable, "-m", "fastar.commands.gpu_check", "--device", device, "--out", out, "--probe"]

    def profile(name, shape, *extra):
        return Step(name, fastar_argv("profile", "--shape", shape, "--device", device, "--dtype", "bf16", "--repeats",
                                      "3", "--out", out / "stats" / f"{name}.json", *extra), "profile", timeout=300)

    def side_by_side(name, shape, *extra):
        """The usual loops beside FastAR's compiled decoders, one image per call; a --decoders in ``extra``
        replaces all (argparse keeps the last)."""
        return replace(profile(name, shape, "--windows", "1", "--batches", "1", "--repeats", "2", "--compile",
                               "--no-eager-twin", "--baselines", "--decoders", "all", *extra), timeout=420)

    compiled = {"TORCH_LOGS": "perf_hints"}  # inductor says why it skips CUDA graphs (the step's notes)
    official = ["--llamagen-code", llamagen_code] if llamagen_code else []
    return [
        # whole images for LlamaGen-XL (SJD's latency speed-up against its step compression), forwards for 7B
        replace(profile("profile-llamagen-xl-compiled", "llamagen-xl", "--windows", "1,16", "--batches", "2",
                        "--compile", "--repeats", "2", "--kernels"), env=compiled),
        replace(profile("profile-anole-7b-compiled", "anole-7b", "--windows", "1,16", "--batches", "2",
                        "--no-decoders", "--compile", "--kernels"), env=compiled),
        # a 7B step's layers as four fused kernels each (kernels/fused_matmul.py) against inductor's compiled layers
        Step("fused-layer", [*map(str, probe), "fused-layer"], "probes", timeout=240),
        # side by side with what users run today, on random weights of the real shapes (their decoders' forwards per
        # call mean nothing, their times do): every decoder on LlamaGen-XL beside LlamaGen's own loop; ar and sjd on
        # the 7B shapes beside transformers'; then the trained demo (real acceptance, its EAGLE drafter). Each
        # decoder's steps compile first (tens of seconds each): the 7B tables keep to two
        side_by_side("side-by-side-llamagen-xl", "llamagen-xl", *official),
        side_by_side("side-by-side-janus-pro-7b", "janus-pro-7b", "--grid", "16x16", "--decoders", "ar,sjd"),
        side_by_side("side-by-side-anole-7b", "anole-7b", "--grid", "16x16", "--decoders", "ar,sjd"),
        side_by_side("side-by-side-demo", "demo", "--model", DEMO / "demo_c2i.safetensors", "--drafter",
                     DEMO / "demo_drafter", *official),
        Step("sync-counts", [*map(str, probe), "sync"], "probes", timeout=180),
        Step("memory-7b", [*map(str, probe), "memory"], "probes", timeout=180),
        Step("w8-kernel", [*map(str, probe), "w8"], "probes", timeout=180),
        Step("w8-inductor", [*map(str, probe), "w8-inductor"], "probes", timeout=240),  # autotuning: minutes
        profile("profile-llamagen-xl", "llamagen-xl", "--windows", "1,16,32", "--batches", "1,2"),
        profile("profile-anole-7b", "anole-7b", "--windows", "1,16,32", "--batches", "1,2", "--no-decoders"),
        # inductor's Triton matrix products (epilogues fused, no split-K reductions): fewer kernels, fewer gaps?
        replace(profile("profile-anole-7b-max-autotune", "anole-7b", "--windows", "1,16", "--batches", "2",
                        "--no-decoders", "--compile", "--compile-mode", "max-autotune", "--kernels"),
                env=compiled, timeout=480),  # autotuning each product's shape: minutes
        # MAR-B's reverse process eagerly (about 100 small ops per reverse step) and on compiled steps
        profile("profile-mar-b-compiled", "mar-b", "--batches", "1,2", "--no-decoders", "--compile"),
        # int8 blocks, the dequantisation fused into compiled steps (goal: 1.6x the bf16 step)
        replace(profile("profile-anole-7b-compiled-int8", "anole-7b", "--windows", "1,16", "--batches", "2",
                        "--no-decoders", "--compile", "--weights", "int8", "--kernels"), env=compiled),
        # a 7B model on a 12 GB card: 8 GB of its weights on the GPU, the other 6 streamed at every forward
        profile("profile-anole-7b-streamed", "anole-7b", "--windows", "1,16", "--batches", "2", "--no-decoders",
                "--gpu-weights", "8")]


def run_step(step: Step, deadline: float, env: dict) -> Step:
    if time.time() > deadline:
        return step
    t0 = time.time()
    try:
        done = subprocess.run([str(a) for a in step.argv], capture_output=True, text=True, env=env | step.env,
                              timeout=min(step.timeout, max(10, deadline + 60 - t0)), cwd=ROOT.parent)
        output = done.stdout + done.stderr
        step.rc, step.tail = done.returncode, output[-1500:]
        step.notes = sorted({line.strip()[:300] for line in output.splitlines() if "cudagraph" in line.lower()})
    except subprocess.TimeoutExpired as e:
        step.rc, step.tail = -9, f"timed out after {e.timeout:.0f} s"
    step.seconds = round(time.time() - t0, 1)
    step.verdict = "ran" if step.rc == 0 else "FAILED"
    return step


def codes_of(out: Path, name: str):
    path = out / "tokens" / f"{name}.json"
    return json.loads(path.read_text())["tokens"] if path.exists() else None


def latents_path(out: Path, name: str) -> Path:
    return out / "latents" / f"{name}.npy"


def judge(steps: list[Step], out: Path) -> None:
    """Codes against what each step had to equal: 'exact', or the share of codes that agree; MAR's latents: 'close'
    or 'DIFFERS', with how far apart they are."""
    by_name = {s.name: s for s in steps}
    for step in steps:
        if step.rc != 0 or not step.compare:
            continue
        if "latents" in step.compare:
            step.verdict = latents_verdict(out, step.name, by_name.get(step.compare["latents"]))
            continue
        ours = codes_of(out, step.name)
        theirs = step.compare.get("codes") or codes_of(out, step.compare.get("step", ""))
        if ours is None or theirs is None or by_name.get(step.compare.get("step"), step).rc != 0:
            step.verdict = "no reference"
        elif ours == theirs:
            step.verdict = "exact"
        else:
            flat = lambda codes: [c for row in codes for c in (row if isinstance(row, list) else [row])]
            a, b = flat(ours), flat(theirs)
            same = sum(x == y for x, y in zip(a, b)) / max(len(a), len(b), 1)
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            step.verdict = f"DIFFERS ({same:.1%} agree, first at {first})"


def latents_verdict(out: Path, name: str, reference: Step | None) -> str:
    import numpy as np

    theirs = latents_path(out, reference.name) if reference is not None and reference.rc == 0 else None
    if theirs is None or not theirs.exists() or not latents_path(out, name).exists():
        return "no reference"
    ours, theirs = np.load(latents_path(out, name)), np.load(theirs)
    if ours.shape != theirs.shape:
        return f"DIFFERS (shape {list(ours.shape)} against {list(theirs.shape)})"
    difference, scale = np.abs(ours - theirs), max(float(np.abs(theirs).mean()), 1e-12)
    apart, mean = float(np.median(difference)) / scale, float(difference.mean()) / scale
    return f"{'close' if apart < LATENTS_CLOSE else 'DIFFERS'} ({apart:.1e} apart, mean {mean:.1e})"


def precision_sheet(steps: list[Step], out: Path) -> None:
    """Every half-precision image in one PNG: a row per family and decoder, columns fp32, bf16, fp16."""
    from PIL import Image, ImageDraw

    rows: dict[str, dict[str, Path]] = {}
    for step in steps:
        if step.image and step.rc == 0 and step.group == "half-precision":
            key, dtype = step.name.rsplit("-", 1)
            files = sorted(Path(step.image).parent.glob(Path(step.image).stem + "*.png"))
            if files:
                rows.setdefault(key, {})[dtype] = files
    if not rows:
        return
    cell, label = 96, 170
    sheet = Image.new("RGB", (label + 3 * 4 * cell, len(rows) * cell), "white")
    draw = ImageDraw.Draw(sheet)
    for r, (key, by_dtype) in enumerate(sorted(rows.items())):
        draw.text((4, r * cell + cell // 2), key, fill="black")
        for c, dtype in enumerate(("fp32", "bf16", "fp16")):
            for i, path in enumerate(by_dtype.get(dtype, [])[:4]):
                tile = Image.open(path).convert("RGB").resize((cell - 4, cell - 4))
                sheet.paste(tile, (label + (c * 4 + i) * cell, r * cell))
    sheet.save(out / "precision.png")


def write_report(steps: list[Step], out: Path, environment: dict) -> None:
    profiles = {p.stem: json.loads(p.read_text()) for p in (out / "stats").glob("profile-*.json")}
    probes = {p.stem: json.loads(p.read_text()) for p in (out / "stats").glob("probe-*.json")}
    report = {"environment": environment, "steps": [{k: v for k, v in vars(s).items() if k not in ("argv", "compare")}
                                                    | {"command": " ".join(map(str, s.argv[2:]))} for s in steps],
              "probes": probes, "profiles": profiles}
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    lines = ["# GPU check", "", "```", json.dumps(environment, indent=1), "```", "",
             "| step | group | verdict | s |", "|---|---|---|---|"]
    lines += [f"| {s.name} | {s.group} | {s.verdict} | {s.seconds} |" for s in steps]
    for s in steps:
        if s.notes:
            lines += ["", f"## {s.name}: CUDA graphs", "```", *s.notes[:20], "```"]
    failed = [s for s in steps if s.verdict == "FAILED"]
    for s in failed:
        lines += ["", f"## {s.name} failed", "```", " ".join(map(str, s.argv[2:])), s.tail, "```"]
    lines += ["", "## goals", "", *goal_lines(profiles)]
    lines += ["", "## side by side with the usual loops (same GPU, weights, dtype and prompt)", "",
              *side_by_side_lines(profiles)]
    lines += ["", "## a 7B step's layers without attention: inductor's against four fused kernels a layer", "",
              *fused_layer_lines(probes.get("probe-fused-layer"))]
    lines += ["", "## where a forward's time goes (ms per forward)", "", *kernel_lines(profiles)]
    lines += ["", "## probes", "```", json.dumps(probes, indent=1), "```", "", "## profiles", "```",
              json.dumps(profiles, indent=1)[:20000], "```"]
    (out / "report.md").write_text("\n".join(lines))


FLOOR_GOAL, SJD_GOAL = 1.25, 0.9  # an iteration within 1.25x the floor; SJD's latency >= 0.9 x its compression
TRANSFORMERS_GOAL = 3.0  # FastAR's ar against transformers' generate on the same weights
INT8_GOAL = 1.6  # issue 35: a compiled int8 step of a 7B shape at batch 2 against the bf16 one


def goal_lines(profiles: dict) -> list[str]:
    """The speed goals, per profile and batch: the 1-token forward and each decoder's iteration against the
    bandwidth floor, SJD's latency speed-up over ar against its step compression (whole images, when the profile
    ran them), and ar against transformers' generate."""
    lines = []
    for name, profile in sorted(profiles.items()):
        for batch, entry in profile.get("batches", {}).items():
            if "head_ms" in entry:
                continue  # a MAR profile (mar_lines)
            ratio = entry["forward_over_floor"]
            line = (f"- {name}, batch {batch}: forward {entry['forward_ms']['1']:.2f} ms, {ratio:.2f}x the "
                    f"{entry['floor_ms']:.2f} ms floor ({'meets' if ratio <= FLOOR_GOAL else 'misses'} "
                    f"{FLOOR_GOAL}x)")
            if "whole_cache_forward_ms" in entry:  # the filled slots' saving (transformer.attended_slots)
                line += f", {entry['whole_cache_forward_ms']:.2f} ms attending over the whole cache"
            if profile.get("streamed_gb"):  # its floor: the streamed weights cross from host memory
                line += (f"; {profile['streamed_gb']:.1f} GB of weights streamed at "
                         f"{profile['host_bandwidth_gb_s']:.1f} GB/s")
            decoders = entry.get("decoders", {})
            if decoders:
                line += "; iterations against the floor: " + ", ".join(
                    f"{decoder} {cost['over_floor']:.2f}x" for decoder, cost in decoders.items())
            if "ar" in decoders and "sjd" in decoders:
                ar, sjd = decoders["ar"], decoders["sjd"]
                speedup, compression = ar["image_s"] / sjd["image_s"], ar["target_forwards"] / sjd["target_forwards"]
                share = speedup / compression
                line += (f"; sjd {speedup:.2f}x faster than ar per image for {compression:.2f}x fewer forwards "
                         f"({share:.2f} of it: {'meets' if share >= SJD_GOAL else 'misses'} {SJD_GOAL})")
                line += sjd_variants(entry)
            transformers = entry.get("baselines", {}).get("transformers generate()")
            if transformers:
                line += (f"; ar {transformers['ar_speedup']:.2f}x faster than transformers' generate "
                         f"({'meets' if transformers['ar_speedup'] >= TRANSFORMERS_GOAL else 'misses'} "
                         f"{TRANSFORMERS_GOAL}x)")
            lines.append(line)
    lines += int8_lines(profiles) + mar_lines(profiles)
    return lines or ["- no token profile ran"]


def side_by_side_lines(profiles: dict) -> list[str]:
    """Each profile's table of the usual loops beside FastAR's decoders (profile --baselines)."""
    lines = []
    for name, profile in sorted(profiles.items()):
        for batch, entry in profile.get("batches", {}).items():
            if entry.get("side_by_side"):
                weights = ("random weights: the decoders' forwards per call mean nothing, their times do"
                           if profile["random_weights"] else "trained weights")
                lines += [f"### {profile['shape']}, batch {batch}, grid {profile['grid']} ({weights})", "",
                          *entry["side_by_side"], ""]
    return lines or ["- no profile ran with --baselines"]


def mar_lines(profiles: dict) -> list[str]:
    """MAR's reverse process per MAR step, eagerly and on compiled steps (profile --compile of a MAR shape)."""
    lines = []
    for name, profile in sorted(profiles.items()):
        for batch, entry in profile.get("batches", {}).items():
            if "head_process_ms" in entry:
                compiled = entry.get("compiled_head")
                line = (f"- {name}, batch {batch}: a MAR step's reverse process {entry['head_process_ms']:.1f} ms "
                        "eagerly" + (f", {compiled['head_process_ms']:.1f} ms on compiled steps "
                                     f"({compiled['speedup']:.2f}x; latents {compiled['apart']:.1e} apart)"
                                     if compiled else ""))
                line += f"; transformer call {entry['forward_ms']:.1f} ms eagerly" + (
                    f", {entry['compiled_forward_ms']:.1f} ms compiled" if "compiled_forward_ms" in entry else "")
                lines.append(line)
    return lines


SJD_VARIANT_NAMES = {"full_guards_decoders": "every call guarded in full",
                     "eager_loop_step_decoders": "sampling and verification eager"}


def sjd_variants(entry: dict) -> str:
    """A compiled profile's sjd timed again with one saving undone (profile --compile), against the default."""
    variants = {what: entry[key]["sjd"]["ms_per_iteration"] for key, what in SJD_VARIANT_NAMES.items()
                if "sjd" in entry.get(key, {})}
    if not variants:
        return ""
    sjd = entry["decoders"]["sjd"]["ms_per_iteration"]
    return f"; sjd {sjd:.2f} ms per iteration, with " + ", with ".join(
        f"{what} {ms:.2f} ({sjd / ms:.2f}x)" for what, ms in variants.items())


def int8_lines(profiles: dict) -> list[str]:
    """Compiled int8 steps against compiled bf16 ones of the same shape and batch."""
    lines = []
    for name, profile in sorted(profiles.items()):
        full = profiles.get(name.removesuffix("-int8")) if name.endswith("-int8") else None
        for batch, entry in (profile.get("batches", {}).items() if full else ()):
            if batch in full.get("batches", {}):
                speedup = full["batches"][batch]["forward_ms"]["1"] / entry["forward_ms"]["1"]
                lines.append(f"- {name}, batch {batch}: int8 step {entry['forward_ms']['1']:.2f} ms, {speedup:.2f}x the "
                             f"bf16 step ({'meets' if speedup >= INT8_GOAL else 'misses'} {INT8_GOAL}x)")
    return lines


def fused_layer_lines(probe: dict | None) -> list[str]:
    """The fused-layer probe per row count: both ways' ms per step, the floor, the fastest tiles."""
    if not probe:
        return ["- the fused-layer probe did not run"]
    lines = []
    for rows, tiles in probe["fused_tiles_ms"].items():
        if isinstance(tiles, str):
            lines.append(f"- {rows}: {tiles}")
            continue
        torch_ms, fused_ms = probe["ms_per_step"][f"torch compiled {rows}"], probe["ms_per_step"][f"fused {rows}"]
        best = min(tiles, key=tiles.get) if tiles else None
        lines.append(f"- {rows}: torch compiled {torch_ms:.3f} ms, fused {fused_ms:.3f} ms ({torch_ms / fused_ms:.2f}x)"
                     f" against a {probe.get('floor_ms', 0):.3f} ms floor; outputs "
                     f"{probe['relative_difference'][rows]:.1e} apart"
                     + (f"; fastest tiles {best}: {tiles[best]:.3f} ms" if best else ""))
    return lines


def kernel_lines(profiles: dict) -> list[str]:
    """``--kernels`` profiles: each window's wall time, the kernels' busy time by group, and the busiest kernel."""
    lines = []
    for name, profile in sorted(profiles.items()):
        for batch, entry in profile.get("batches", {}).items():
            for window, k in entry.get("kernels", {}).items():
                groups = ", ".join(f"{group} {ms:.2f}" for group, ms in k["groups_ms"].items())
                busiest = k["top"][0] if k["top"] else {"name": "-", "ms": 0.0}
                host = k.get("dynamo_host_ms", {})
                lines.append(f"- {name}, batch {batch}, W={window}: {k['wall_ms']:.2f} wall, {k['busy_ms']:.2f} busy "
                             f"({groups}); busiest {busiest['ms']:.3f} {busiest['name'][:80]}; dynamo on the host: "
                             f"guards {host.get('guards', 0):.3f}, inputs {host.get('inputs', 0):.3f}")
    return lines or ["- no profile ran with --kernels"]


def environment() -> dict:
    import torch

    info = {"torch": torch.__version__, "python": sys.version.split()[0], "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info |= {"gpu": p.name, "memory_gb": round(p.total_memory / 1e9, 1), "capability": f"{p.major}.{p.minor}",
                 "bf16": torch.cuda.is_bf16_supported()}
    return info


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out/gpu_check")
    p.add_argument("--device", default="cuda")
    p.add_argument("--budget", type=float, default=480, help="seconds after which no new step starts")
    p.add_argument("--workers", type=int, default=4, help="correctness steps run at once")
    p.add_argument("--only", help="run only the steps whose name contains one of these comma-separated texts "
                                  "(e.g. var,conformance)")
    p.add_argument("--llamagen-code", help="a checkout of FoundationVision/LlamaGen: its generate() joins the "
                                           "side-by-side runs of the LlamaGen shapes")
    p.add_argument("--probe", choices=sorted(PROBES), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    if args.probe:
        result = PROBES[args.probe](args.device, out)
        (out / "stats" / f"probe-{args.probe}.json").write_text(json.dumps(result, indent=1))
        print(json.dumps(result, indent=1))
        return 0
    for sub in ("images", "tokens", "latents", "stats"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    deadline = time.time() + args.budget
    env = os.environ | {"OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1"}
    chosen = lambda step: not args.only or any(part in step.name for part in args.only.split(","))  # noqa: E731
    steps = [s for s in correctness_steps(out, args.device) if chosen(s)]
    code = str(Path(args.llamagen_code).resolve()) if args.llamagen_code else None  # the steps run from elsewhere
    later = [s for s in probe_and_profile_steps(out, args.device, code) if chosen(s)]
    reserve = 200 if later else 0  # time left for the timed steps, when any will run
    with ThreadPoolExecutor(args.workers) as pool:
        list(pool.map(lambda s: run_step(s, deadline - reserve, env), steps))
    for step in later:
        run_step(step, deadline, os.environ | {"PYTHONUNBUFFERED": "1"})
    steps += later
    judge(steps, out)
    precision_sheet(steps, out)
    write_report(steps, out, environment())
    bad = [s.name for s in steps if s.verdict == "FAILED" or s.verdict.startswith("DIFFERS")]
    print(f"{len(steps)} steps, {sum(s.rc is None for s in steps)} skipped, problems: {bad or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
