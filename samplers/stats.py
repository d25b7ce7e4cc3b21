"""DecodeStats: what every decoder reports next to its tokens (a product feature, not a debug aid)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class DecodeStats:
    decoder: str
    grid: tuple[int, int]
    batch: int
    target_forwards: int = 0  # prefill excluded, every verification forward included
    drafter_forwards: int = 0
    drafted_tokens: int = 0  # drafted tokens the target verified (CSpD)
    accepted_tokens: int = 0  # of those, the ones kept as drafted
    resample_tries: int = 0  # residual proposals drawn for the rejected ones (CSpD's acceptance-rejection)
    resample_fallbacks: int = 0  # rejected tokens whose proposals were all refused: a plain target sample
    accepted_per_iteration: list[list[int]] = field(default_factory=list)  # [iteration][row]
    fixed_at: list[list[int]] = field(default_factory=list)  # [row][token]: iteration that fixed it (0 = prefill)
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

    @property
    def decode_time_s(self) -> float:
        """The wall time without compilation: what the decoder costs from its second run of a shape on."""
        return self.wall_time_s - self.compile_time_s

    @property
    def num_tokens(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def tokens(self) -> list[int]:
        return [self.num_tokens] * self.batch

    @property
    def step_compression(self) -> float:
        """Image tokens per target forward for the batch as a whole."""
        return self.num_tokens / max(self.target_forwards, 1)

    @property
    def row_forwards(self) -> list[int]:
        """Forwards each row needed (rows advance independently)."""
        return [max(row) for row in self.fixed_at]

    @property
    def mean_accepted(self) -> float:
        """Mean tokens fixed per iteration, over the iterations each row was still running."""
        counts = [c for it in self.accepted_per_iteration for c in it if c > 0]
        return float(np.mean(counts)) if counts else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / verified drafted tokens; None when nothing was drafted token by token."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    @property
    def reuse_note(self) -> str | None:
        """What MAR's feature reuse did, in words (None without it)."""
        if self.transformer_work is None:
            return None
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
            "tokens": self.tokens,
            "target_forwards": self.target_forwards,
            "drafter_forwards": self.drafter_forwards,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "resample_tries": self.resample_tries,
            "resample_fallbacks": self.resample_fallbacks,
            "step_compression": self.step_compression,
            "row_step_compression": [self.num_tokens / max(f, 1) for f in self.row_forwards],
            "mean_accepted": self.mean_accepted,
            "accepted_per_iteration": self.accepted_per_iteration,
            "fixed_at": self.fixed_at,
            "wall_time_s": self.wall_time_s,
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
    values = np.asarray(fixed_at, dtype=np.float32).reshape(grid)
    t = values / max(values.max(), 1.0)
    # a small perceptual ramp (dark blue -> teal -> yellow) without a plotting dependency
    stops = np.array([[0.05, 0.03, 0.3], [0.1, 0.55, 0.55], [0.99, 0.9, 0.15]], dtype=np.float32)
    pos = t * (len(stops) - 1)
    lo = np.clip(pos.astype(int), 0, len(stops) - 2)
    frac = (pos - lo)[..., None]
    rgb = stops[lo] * (1 - frac) + stops[lo + 1] * frac
    rgb = np.repeat(np.repeat(rgb, scale, axis=0), scale, axis=1)
    return (rgb * 255).round().astype(np.uint8)
