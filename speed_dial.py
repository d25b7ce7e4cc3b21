"""The speed dial: ``lossless``, ``balanced`` or ``fast`` -> the decoder and settings that measured fastest at that
quality on the model's kind, with the drafter when one is connected, on this device (docs/speed.md has the table).

Each kind's candidates carry what a benchmark measured of them on its bundled demo model (``python -m fastar bench
--dial`` measures them again): step compression, class accuracy and Frechet distance beside plain sampling's, and
the latency ratio on a 2-core CPU. A level admits the candidates whose quality stays within its bounds of plain
sampling's (lossless: exactly its distribution) and picks the fastest on this device:
- where a forward over a window costs about what a one-token forward does (a GPU: c(W) near 1 up to 32 tokens per
  image, as profiled on an H200), by step compression, among the candidates that feed at most 32 tokens per image
  and forward;
- on a CPU, where a 16-token window costs about two one-token forwards, by the latency measured on a 2-core CPU;
  a decoder less than MIN_GAIN faster there (SJD's windows, on that CPU) is not worth it.
The pick depends on nothing timed at run time: the same settings always pick the same decoder.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace

import torch

from .errors import FastARError, check_choice
from .model_loaders.shared.compiled import compiled_mode
from .samplers.decoders import (DECODER_BY_NAME, FEW_STEP, LOSSLESS, MASKED_AR, NEXT_SCALE, TOKEN_AR, WINDOWED,
                                DecoderSpec)
from .samplers.masked_loops.feature_reuse import FeatureReuse

SPEEDS = ("lossless", "balanced", "fast")
BOUNDS = {  # a level's quality bounds against plain sampling: class accuracy points lost, Frechet distance ratio
    "balanced": (5.0, 1.5),
    "fast": (10.0, 3.0),
}
FLAT_WIDTH = 32  # tokens per image a GPU forward takes at about a one-token forward's cost (c(16) 1.02-1.12, H200)
FLAT_COST = 1.3  # c(16) at or below it: a machine prices windows as a GPU does (bench --dial's own picks)
MIN_GAIN = 1.2  # faster than plain sampling by less is noise: one decoder's CPU latency ratio moves 0.05-0.1 a run


@dataclass(frozen=True)
class Candidate:
    """A decoder and its settings, with what the benchmark measured of it on the kind's bundled demo model."""

    label: str
    decoder: str
    settings: dict = field(default_factory=dict)  # DecoderSpec fields; MAR: steps (a share of the model's), reuse
    drafter: bool = False  # drafts with the connected drafter
    width: int = 1  # the most tokens a forward feeds per image (what a window's cost depends on)
    steps: float = 1.0  # step compression against plain sampling
    accuracy: float = 0.0  # class accuracy, %
    frechet: float = 0.0  # Frechet distance to real images (the demo classifier's features)
    cpu_speedup: float = 1.0  # latency ratio against plain sampling, batch 1 with CFG, 2-core CPU

    @property
    def lossless(self) -> bool:
        return LOSSLESS[self.decoder] and "reuse" not in self.settings and self.settings.get("steps", 1.0) == 1.0

    @property
    def distribution(self) -> str:
        """What it samples: plain sampling's for lossless ones, ZipAR's at its lead with or without drafts inside
        the rows (those are verified against what ZipAR shows each token), else its own."""
        if self.lossless:
            return "exact"
        if self.decoder in ("zipar", "zipar-sjd"):
            return f"zipar, lead {self.settings['zipar_lead']}"
        return self.label


# Token models (LlamaGen, Lumina-mGPT, Anole, Janus-Pro), measured on the bundled class demo by python -m fastar bench
# --dial (128 samples each, cfg 2, latency from 9 interleaved batch-1 runs on a 2-core CPU): plain AR first. One
# distribution's candidates share its quality (the mean of their runs), and width is the most tokens a forward feeds.
TOKEN_CANDIDATES = (
    Candidate("ar", "ar",
              width=1, steps=1.0, accuracy=89.5, frechet=3.47, cpu_speedup=1.0),
    Candidate("sjd, window 16", "sjd", {"window": 16},
              width=16, steps=2.07, accuracy=89.5, frechet=3.47, cpu_speedup=1.03),
    Candidate("sjd, maximal coupling, window 32", "sjd", {"window": 32, "coupling": "maximal"},
              width=32, steps=3.15, accuracy=89.5, frechet=3.47, cpu_speedup=1.17),
    Candidate("sjd, gumbel coupling, window 32", "sjd", {"window": 32, "coupling": "gumbel"},
              width=32, steps=3.1, accuracy=89.5, frechet=3.47, cpu_speedup=1.05),
    Candidate("gsd, maximal coupling, window 32", "gsd", {"window": 32, "coupling": "maximal"},
              width=32, steps=3.42, accuracy=89.8, frechet=3.35, cpu_speedup=1.15),
    Candidate("spec, drafter, gamma 4", "spec", {"gamma": 4}, drafter=True,
              width=5, steps=2.88, accuracy=89.5, frechet=3.47, cpu_speedup=0.95),
    Candidate("lantern, drafter, delta 0.1", "lantern", {"gamma": 4, "lantern_delta": 0.1}, drafter=True,
              width=5, steps=4.47, accuracy=81.2, frechet=10.06, cpu_speedup=1.47),
    Candidate("zipar, lead 4", "zipar", {"zipar_lead": 4},
              width=10, steps=2.94, accuracy=87.9, frechet=5.13, cpu_speedup=2.02),
    Candidate("zipar, lead 3", "zipar", {"zipar_lead": 3},
              width=14, steps=3.51, accuracy=89.1, frechet=5.82, cpu_speedup=2.38),
    Candidate("zipar, lead 2", "zipar", {"zipar_lead": 2},
              width=18, steps=4.34, accuracy=87.2, frechet=6.23, cpu_speedup=2.86),
    Candidate("zipar-sjd, lead 4, maximal coupling, window 4", "zipar-sjd",
              {"zipar_lead": 4, "window": 4, "coupling": "maximal"},
              width=25, steps=3.12, accuracy=87.9, frechet=5.13, cpu_speedup=1.71),
    Candidate("zipar-sjd, lead 3, maximal coupling, window 3", "zipar-sjd",
              {"zipar_lead": 3, "window": 3, "coupling": "maximal"},
              width=28, steps=3.63, accuracy=89.1, frechet=5.82, cpu_speedup=2.02),
    Candidate("zipar-sjd, lead 2, maximal coupling, window 2", "zipar-sjd",
              {"zipar_lead": 2, "window": 2, "coupling": "maximal"},
              width=27, steps=4.43, accuracy=87.2, frechet=6.23, cpu_speedup=2.48),
    Candidate("zipar-sjd, lead 2, maximal coupling, window 4", "zipar-sjd",
              {"zipar_lead": 2, "window": 4, "coupling": "maximal"},
              width=45, steps=4.45, accuracy=87.2, frechet=6.23, cpu_speedup=2.33),
)
# MAR, measured on the bundled demo MAR (its own 32 steps, cfg 3, 50 diffusion steps; python -m fastar bench --mar):
# the latency ratio is the time the user waits, whatever the device's balance of transformer and head.
MAR_CANDIDATES = (
    Candidate("MAR, the model's steps", "ar", accuracy=70.3, frechet=34.4),
    Candidate("MAR, half the steps", "ar", {"steps": 0.5}, steps=2.0, accuracy=75.0, frechet=36.0, cpu_speedup=1.54),
    Candidate("MAR, a quarter of the steps", "ar", {"steps": 0.25}, steps=4.0, accuracy=64.1, frechet=42.6,
              cpu_speedup=2.52),
    Candidate("MAR with feature reuse (from 0.1)", "ar", {"reuse": FeatureReuse()}, accuracy=75.0, frechet=39.2,
              cpu_speedup=1.38),
    Candidate("MAR with feature reuse, half the steps", "ar", {"steps": 0.5, "reuse": FeatureReuse(start_percent=0.2)},
              steps=2.0, accuracy=70.3, frechet=39.3, cpu_speedup=2.44),
)
VAR_CANDIDATES = (Candidate("VAR, one forward per scale", "ar", accuracy=82.0, frechet=24.4),)
DD_CANDIDATES = (  # a student is its own sampler: two steps keep more of its teacher than one
    Candidate("DD, 2 steps", "dd", {"dd_steps": 2}, accuracy=28.1, frechet=121.5),
    Candidate("DD, 1 step", "dd", {"dd_steps": 1}, steps=2.0, accuracy=25.0, frechet=207.6, cpu_speedup=2.0),
)
CANDIDATES = {TOKEN_AR: TOKEN_CANDIDATES, MASKED_AR: MAR_CANDIDATES, NEXT_SCALE: VAR_CANDIDATES,
              FEW_STEP: DD_CANDIDATES}
ONLY_SAMPLER = {NEXT_SCALE: "VAR's own sampler is the only one for a VAR model (a scale's tokens are no raster "
                            "sequence to draft)"}


@dataclass(frozen=True)
class Choice:
    """What the dial picked, and why, in words for the command line and the Stats node."""

    speed: str
    candidate: Candidate
    why: str

    @property
    def decoder(self) -> str:
        return self.candidate.decoder

    def spec(self) -> DecoderSpec:
        """A token model's decoder settings (the others' come from ``masked`` and ``dd_steps``)."""
        fields = {k: v for k, v in self.candidate.settings.items() if k in DecoderSpec.__dataclass_fields__}
        return DecoderSpec(decoder=self.decoder, **fields)

    def masked(self, settings):
        """MAR's settings at the model's own (``settings``): the candidate's share of its steps, its reuse."""
        steps = max(1, round(settings.num_iter * self.candidate.settings.get("steps", 1.0)))
        return replace(settings, num_iter=steps, reuse=self.candidate.settings.get("reuse"))

    @property
    def dd_steps(self) -> int:
        return self.candidate.settings.get("dd_steps", 2)

    def summary(self) -> dict:
        return {"speed": self.speed, "picked": self.candidate.label, "why": self.why}


def choose(model, speed: str, drafter=None, codebook: bool = True, keep_steps: bool = False) -> Choice:
    """The dial's pick for ``model`` (its kind and device) at ``speed``; ``drafter``: the connected drafter, if any;
    ``codebook``: whether the image decoder's codebook is at hand (LANTERN's neighbours need it); ``keep_steps``:
    MAR's steps were given, so the dial keeps them (and may still reuse features). The same model, drafter, device
    and speed always give the same pick."""
    check_choice("speed", speed, SPEEDS)
    kind = getattr(model, "kind", TOKEN_AR)
    candidates = [c for c in CANDIDATES[kind] if (drafter is not None or not c.drafter)
                  and (codebook or not DECODER_BY_NAME[c.decoder].codebook or kind == FEW_STEP)
                  and not (keep_steps and c.settings.get("steps", 1.0) != 1.0)]
    baseline = candidates[0]
    if kind in ONLY_SAMPLER:
        return Choice(speed, baseline, ONLY_SAMPLER[kind])
    if kind != TOKEN_AR:  # no window to price: what the user waits, as measured, decides
        admitted = [c for c in candidates if admits(speed, c, baseline)]
        best = max(admitted, key=lambda c: c.cpu_speedup)
        return Choice(speed, best, reason(speed, best, baseline, f"{best.cpu_speedup:.2f}x faster (2-core CPU)"))
    return pick(candidates, speed, device_pricing(model.device), str(model.device))


def pick(candidates, speed: str, pricing: "WindowPricing", device: str) -> Choice:
    """Among a token model's ``candidates`` (plain AR first), the one the ``speed`` level admits that is fastest
    where windows cost what ``pricing`` says; one less than MIN_GAIN faster than plain sampling is not worth it."""
    baseline = candidates[0]
    admitted = [c for c in candidates if admits(speed, c, baseline)]
    if pricing.flat:
        fitting = [c for c in admitted if c.width <= FLAT_WIDTH]
        best = max(fitting, key=lambda c: c.steps)
        where = (f"on {device} a forward of up to {FLAT_WIDTH} tokens per image costs about one of 1 token (as profiled "
                 "on a GPU), so the most steps saved win")
        return Choice(speed, best, f"{where}: " + reason(speed, best, baseline, f"{best.steps:.2f}x fewer steps"))

    def here(c: Candidate) -> float:  # the CPU's measured speed-up, its windows priced as on this device
        return c.cpu_speedup * CPU_PRICING.of(c.width) / pricing.of(c.width)

    worth = [c for c in admitted if c is baseline or here(c) >= MIN_GAIN]
    best = max(worth, key=here)
    where = (f"on {device} a 16-token forward costs {pricing.of(16):.2f} one-token forwards (measured here; "
             f"{CPU_PRICING.of(16):.2f} on the 2-core CPU the latencies were measured on)" if pricing.measured else
             f"on {device}, priced as the 2-core CPU the latencies were measured on (a 16-token forward costs "
             f"{CPU_PRICING.of(16):.2f} one-token forwards there)")
    if best is baseline and speed == "lossless" and len(admitted) > 1:
        runner_up = max(admitted[1:], key=here)
        return Choice(speed, best, f"{where}, so {runner_up.label} would be only {here(runner_up):.2f}x faster than "
                                   "plain sampling: plain sampling is the pick")
    gain = f"about {here(best):.2f}x faster here" if pricing.measured else f"{best.cpu_speedup:.2f}x faster there"
    return Choice(speed, best, f"{where}: " + reason(speed, best, baseline, gain))


def admits(speed: str, candidate: Candidate, baseline: Candidate) -> bool:
    """Lossless candidates at every level (their quality is plain sampling's; a measured difference is noise),
    relaxed ones within the level's bounds; plain sampling always."""
    if candidate.lossless or candidate is baseline:
        return True
    if speed == "lossless":
        return False
    points, ratio = BOUNDS[speed]
    return candidate.accuracy >= baseline.accuracy - points and candidate.frechet <= ratio * baseline.frechet


def reason(speed: str, picked: Candidate, baseline: Candidate, gain: str) -> str:
    if picked is baseline:
        return (f"{picked.label}: " + ("the model's own sampler, exactly its distribution" if picked.lossless else
                                       "nothing measured faster within this level's quality bounds"))
    if picked.lossless:
        return f"{picked.label}: {gain} on the bundled demo, lossless"
    return (f"{picked.label}: {gain} on the bundled demo at class accuracy {picked.accuracy:.1f}% against plain "
            f"sampling's {baseline.accuracy:.1f}% (the {speed} level allows {BOUNDS[speed][0]:g} points and "
            f"{BOUNDS[speed][1]:g}x its Frechet distance)")


@dataclass(frozen=True)
class WindowPricing:
    """What a forward over W tokens costs against a one-token forward on this device: c(W)."""

    costs: dict  # width -> c(width)
    flat: bool
    measured: bool = True  # on this device, now (else the 2-core CPU's, as profiled)

    def of(self, width: int) -> float:
        """c(width), linear between the priced widths and proportional past the widest."""
        known = sorted(self.costs)
        below = max((w for w in known if w <= width), default=known[0])
        above = min((w for w in known if w >= width), default=None)
        if above is None:
            return self.costs[below] * width / below
        if above == below:
            return self.costs[below]
        share = (width - below) / (above - below)
        return self.costs[below] + share * (self.costs[above] - self.costs[below])


PRICED_WIDTHS = (1, 5, 16, 32)
GPU_PRICING = WindowPricing({1: 1.0, FLAT_WIDTH: 1.0}, flat=True, measured=False)  # compiled steps on an H200
CPU_PRICING = WindowPricing({1: 1.0, 2: 1.21, 4: 1.37, 8: 1.55, 16: 1.85, 32: 2.46}, flat=False,  # bench --dial's
                            measured=False)  # 2-core CPU, where the candidates' latency ratios were measured
PRICES: dict = {}  # (model, device, dtype) -> WindowPricing measured for window_note, once per process


def device_pricing(device) -> WindowPricing:
    """What a window costs on ``device``, for the dial: a CPU's as profiled on the 2-core CPU the latencies were
    measured on, any accelerator's flat (as profiled on a GPU). Never timed on the spot, where noise could change
    the pick from one run to the next: the same settings give the same decoder, and so the same image."""
    return CPU_PRICING if torch.device(device).type == "cpu" else GPU_PRICING


def measured_pricing(model, rows) -> WindowPricing:
    """c(W) on this very device, measured with the run's conditioning (``rows``), eagerly, a few forwards per width,
    once per model and process; the profiled CPU's where that cannot be done without compiling a graph per width."""
    if compiled_mode(model) is not None:
        return CPU_PRICING
    key = (id(model), str(model.device), model.dtype)
    if key not in PRICES:
        PRICES[key] = WindowPricing(window_costs(model, rows, PRICED_WIDTHS), flat=False)
    return PRICES[key]


@torch.no_grad()
def window_costs(model, rows, widths, repeats: int = 3, cfg: bool = True) -> dict:
    """c(W) for each width: a forward over W tokens at mid-image against a one-token forward (medians), with the
    guidance rows unless ``cfg`` is off."""
    tokens = model.grid[0] * model.grid[1]
    session = model.start(rows, cfg=cfg, max_window=max(widths))
    start = torch.full((rows.batch,), tokens // 2, dtype=torch.long, device=model.device)
    seconds = {}
    for width in widths:
        fed = torch.zeros(rows.batch, width, dtype=torch.long, device=model.device)
        keys = session.key_slots(tokens // 2 + width)
        session.forward(fed, start, keys)  # warm-up
        samples = []
        for _ in range(repeats):
            began = time.perf_counter()
            session.forward(fed, start, keys)
            if model.device.type == "cuda":
                torch.cuda.synchronize(model.device)
            samples.append(time.perf_counter() - began)
        seconds[width] = statistics.median(samples)
    return {w: seconds[w] / seconds[1] for w in widths}


def window_note(model, spec: DecoderSpec, stats, rows) -> str | None:
    """For a Jacobi-window decoder picked by hand on a device where windows are not flat: one line on what a window
    costs here, and so what its fewer steps are worth."""
    if spec.decoder not in WINDOWED or stats.drafter_forwards or device_pricing(model.device).flat:
        return None
    pricing = measured_pricing(model, rows)  # one window per image: what it costs here, measured
    cost = pricing.of(spec.window)
    measured = "measured now" if pricing.measured else "as on a 2-core CPU"
    return (f"on {model.device} a forward over {spec.window} tokens costs {cost:.2f} one-token forwards ({measured}), "
            f"so {stats.steps_saved:.2f}x fewer steps are about {stats.steps_saved / cost:.2f}x faster than plain AR "
            "here; --decoder auto (the FastAR Sampler node) picks the fastest decoder for this device")


def check_auto(decoder: str | None, speed: str | None) -> None:
    """--speed is the dial's: it picks the decoder, so it goes with --decoder auto (the default) only."""
    if speed is not None and decoder not in (None, "auto"):
        raise FastARError(f"--speed {speed} picks a decoder for you; with --decoder {decoder} it would do nothing: "
                          "give --decoder auto (the default) or leave --speed out")
