"""DecodeStats: what every decoder reports next to its tokens (a product feature, not a debug aid).

One definition per field, the same for every decoder and model family (docs/statistics.md has the table):
a *forward* is one call of the model after the prompt's prefill, for the whole batch at once; a token is
*fixed* by the forward whose output it was drawn from (or accepted against), for good."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class DecodeStats:
    decoder: str
    grid: tuple[int, int]  # the token grid the image decoder reads (VAR: its last scale)
    batch: int
    tokens: int = 0  # tokens each image is made of: the grid's (0 given), VAR's over all its scales
    target_forwards: int = 0  # the model's forwards for the whole batch, prefill excluded
    baseline: str = ""  # the family's plain sampler, in words ("plain AR", "plain MAR at 64 steps", ...)
    baseline_forwards: int = 0  # the forwards it takes for the same image
    drafter_forwards: int = 0
    drafted_tokens: int = 0  # drafts the target judged, left to right up to the first rejected one (trees: each
    # sibling tried along the accepted path)
    accepted_tokens: int = 0  # of those, the ones kept as drafted
    resample_tries: int = 0  # residual proposals drawn for the rejected ones (CSpD's acceptance-rejection)
    resample_fallbacks: int = 0  # rejected tokens whose proposals were all refused: a plain target sample
    fixed_per_forward: list[list[int]] = field(default_factory=list)  # [forward][image]: tokens it fixed
    fixed_at: list[list[int]] = field(default_factory=list)  # [image][token]: the forward that fixed it (0 = prefill)
    wall_time_s: float = 0.0  # everything the generation waited for, per-generation setup included
    setup_time_s: float = 0.0  # e.g. building GSD's or LANTERN's per-codebook tables (cached after the first)
    forward_time_s: float = 0.0
    verify_time_s: float = 0.0
    drafter_time_s: float = 0.0
    compile_time_s: float = 0.0  # compiling steps of shapes met for the first time (part of wall_time_s)
    # MAR with feature reuse: per step, the share of a plain step's transformer work done; over the generation
    recomputed_share: list[float] = field(default_factory=list)
    transformer_work: float | None = None
    settings: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # quality warnings about this run's settings

    def __post_init__(self):
        self.tokens = self.tokens or self.grid[0] * self.grid[1]

    @property
    def decode_time_s(self) -> float:
        """The wall time without compilation: what the decoder costs from its second run of a shape on."""
        return self.wall_time_s - self.compile_time_s

    @property
    def step_compression(self) -> float:
        """Tokens per forward for the batch as a whole: an image's tokens over the batch's forwards."""
        return self.tokens / max(self.target_forwards, 1)

    @property
    def steps_saved(self) -> float:
        """How many times fewer forwards than the family's plain sampler took (0 when that is unknown)."""
        return self.baseline_forwards / max(self.target_forwards, 1)

    @property
    def row_forwards(self) -> list[int]:
        """Forwards each image needed, up to the one that fixed its last token (images advance independently)."""
        return [max(row) for row in self.fixed_at]

    @property
    def row_step_compression(self) -> list[float]:
        """Each image's tokens over its own forwards."""
        return [self.tokens / max(f, 1) for f in self.row_forwards]

    @property
    def tokens_per_forward(self) -> float:
        """Tokens fixed per forward while an image was unfinished, over the batch's images (the prefill's tokens
        left out). Above step_compression when images of a batch finish at different forwards."""
        fixed = sum(sum(row) for row in self.fixed_per_forward)
        return fixed / max(sum(self.row_forwards), 1)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / judged drafts; None when nothing was drafted."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    def steps_summary(self) -> str:
        """The forwards in words, as the command line and the Stats node say them: steps, never a speed-up (a
        step's cost depends on the decoder and the device; only a timed baseline measures speed)."""
        images = f"{self.batch} images" if self.batch > 1 else "1 image"
        text = f"{images} of {self.tokens} tokens in {self.target_forwards} forward{'s' * (self.target_forwards != 1)}"
        if self.baseline_forwards and self.baseline_forwards != self.target_forwards:
            text += f"; {self.baseline} takes {self.baseline_forwards}: {self.steps_saved:.2f}x fewer steps"
        if self.batch > 1 and self.tokens_per_forward > self.step_compression * 1.05:
            text += (f" (a batch waits for its slowest image: each image took {self.tokens_per_forward:.2f} tokens "
                     "per forward while it ran)")
        return text

    @property
    def reuse_note(self) -> str | None:
        """What MAR's feature reuse or VAR's scale acceleration did, in words (None without either)."""
        if self.transformer_work is None:
            return None
        scales = self.settings.get("scale_acceleration")
        if scales:  # VAR's FastVAR / SkipVAR: the same two fields, per scale
            tokens = "/".join(f"{t:g}" for t in scales["forwarded_tokens"])
            return (f"scale acceleration: tokens forwarded per scale {tokens} (plain "
                    f"{'/'.join(f'{t:g}' for t in scales['plain_tokens'])}), {self.transformer_work:.0%} of the plain "
                    "sampler's transformer FLOPs")
        reused = sum(share < 1.0 for share in self.recomputed_share)
        head = self.settings.get("reuse", {}).get("head_refresh_every")
        cspd = self.decoder.startswith("cspd")  # its target's and draft's calls, each against itself in full
        calls, against = ("model calls", "their full") if cspd else ("steps", "plain MAR's")
        return (f"feature reuse: {reused} of {len(self.recomputed_share)} {calls} reused the cache, "
                f"{self.transformer_work:.0%} of {against} transformer work done; "
                + (f"the diffusion head in full every {head} reverse steps" if head else "the diffusion head exact"))

    def to_json(self) -> dict:
        return {
            "decoder": self.decoder,
            "grid": list(self.grid),
            "batch": self.batch,
            "tokens": self.tokens,
            "target_forwards": self.target_forwards,
            "baseline": self.baseline,
            "baseline_forwards": self.baseline_forwards,
            "step_compression": self.step_compression,
            "steps_saved": self.steps_saved,
            "row_forwards": self.row_forwards,
            "row_step_compression": self.row_step_compression,
            "tokens_per_forward": self.tokens_per_forward,
            "drafter_forwards": self.drafter_forwards,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "resample_tries": self.resample_tries,
            "resample_fallbacks": self.resample_fallbacks,
            "fixed_per_forward": self.fixed_per_forward,
            "fixed_at": self.fixed_at,
            "wall_time_s": self.wall_time_s,
            "compile_time_s": self.compile_time_s,
            "setup_time_s": self.setup_time_s,
            "forward_time_s": self.forward_time_s,
            "verify_time_s": self.verify_time_s,
            "drafter_time_s": self.drafter_time_s,
            "recomputed_share": self.recomputed_share,
            "transformer_work": self.transformer_work,
            "settings": self.settings,
            "warnings": self.warnings,
        }


class Stopwatch:
    """Accumulates time per phase. GPU work is asynchronous and the rule is one host sync per decoding
    iteration, so on CUDA a lap only records an event on the stream (no wait) and the phases are read from the
    events once, when ``totals`` is asked for after the generation; ``elapsed`` waits for the device once, so the
    wall time is what the user waits. Elsewhere a lap reads the host clock (MPS waits for its device first)."""

    def __init__(self, device=None, events=None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.events = events if events is not None else (CudaEvents(self.device) if self.device.type == "cuda" else None)
        self._totals: dict[str, float] = {}
        self._marks: list[tuple[str, object]] = []  # (phase, event that ended it), not yet read
        self._start = self._last = self._now()
        self._previous = self.events.mark() if self.events is not None else None

    def _now(self) -> float:
        if self.device.type == "mps":
            torch.mps.synchronize()
        return time.perf_counter()

    def lap(self, phase: str) -> None:
        if self.events is not None:
            self._marks.append((phase, self.events.mark()))
            return
        now = self._now()
        self._totals[phase] = self._totals.get(phase, 0.0) + now - self._last
        self._last = now

    @property
    def totals(self) -> dict[str, float]:
        """Seconds per phase so far (on CUDA: waits for the device, once for all laps recorded since)."""
        if self._marks:
            self.events.wait()
            for phase, mark in self._marks:
                self._totals[phase] = self._totals.get(phase, 0.0) + self.events.seconds(self._previous, mark)
                self._previous = mark
            self._marks.clear()
        return self._totals

    def elapsed(self) -> float:
        if self.events is not None:
            self.events.wait()
        return self._now() - self._start


class CudaEvents:
    """Timing marks on the device's current stream: recording one does not wait for the device."""

    def __init__(self, device: torch.device):
        self.device = device

    def mark(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def wait(self) -> None:
        torch.cuda.synchronize(self.device)

    @staticmethod
    def seconds(start, end) -> float:
        return start.elapsed_time(end) / 1e3


def acceptance_heatmap(fixed_at: list[int] | torch.Tensor, grid: tuple[int, int], scale: int = 16) -> np.ndarray:
    """Render one row's ``fixed_at`` as an RGB uint8 image: early iterations dark blue, late yellow;
    large same-colour runs show where many tokens were accepted in one forward."""
    values = np.asarray(fixed_at, dtype=np.float32)[-grid[0] * grid[1]:].reshape(grid)  # VAR: the last scale
    t = values / max(values.max(), 1.0)
    # a small perceptual ramp (dark blue -> teal -> yellow) without a plotting dependency
    stops = np.array([[0.05, 0.03, 0.3], [0.1, 0.55, 0.55], [0.99, 0.9, 0.15]], dtype=np.float32)
    pos = t * (len(stops) - 1)
    lo = np.clip(pos.astype(int), 0, len(stops) - 2)
    frac = (pos - lo)[..., None]
    rgb = stops[lo] * (1 - frac) + stops[lo + 1] * frac
    rgb = np.repeat(np.repeat(rgb, scale, axis=0), scale, axis=1)
    return (rgb * 255).round().astype(np.uint8)
