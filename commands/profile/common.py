"""What the profiles of every model kind share (speed.py for token models, mar.py for MAR):
synchronised timing, the device's copy bandwidth, random weights of a shape, whole images timed side by side, and
what an image loop of the usual ones is (loop_baselines.py)."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

# an image loop: (conditioning, sampling, generator) -> codes [B, N]
ImageLoop = Callable[..., torch.Tensor]


def seed_global_generator(generator: torch.Generator) -> None:
    """The usual loops draw from torch's global generator: seed it as ``generator`` is seeded."""
    torch.manual_seed(generator.initial_seed())


@dataclass
class Timing:
    device: torch.device
    repeats: int

    def median_s(self, fn) -> float:
        fn()  # warm-up
        samples = []
        for _ in range(self.repeats):
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def bandwidth(timing: Timing, megabytes: int = 256) -> float:
    """Bytes per second a device copy reads and writes."""
    source = torch.empty(megabytes << 20, dtype=torch.uint8, device=timing.device)
    target = torch.empty_like(source)
    return 2 * source.numel() / timing.median_s(lambda: target.copy_(source))


def host_bandwidth(timing: Timing, megabytes: int = 256) -> float:
    """Bytes per second a copy from pinned host memory to the device moves: what streamed weights cross."""
    source = torch.empty(megabytes << 20, dtype=torch.uint8).pin_memory()
    target = torch.empty_like(source, device=timing.device)
    return source.numel() / timing.median_s(lambda: target.copy_(source, non_blocking=True))


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Small random weights (norm scales around 1), which keep activations finite in fp16."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.02)


def image_costs(runs: dict, timing: Timing, rounds: int) -> tuple[dict, dict]:
    """Whole images of each run (``seed -> (forwards per image, codes)``), interleaved A B C A B C ... after
    one warm-up each: the median seconds per image and the ms per forward (sampling and verification included),
    and each run's codes of the last round (the same seed for every run)."""
    for run in runs.values():
        run(0)
    seconds, forwards, codes = {name: [] for name in runs}, {name: [] for name in runs}, {}
    for round_ in range(rounds):
        for name, run in runs.items():
            timing.sync()
            t0 = time.perf_counter()
            count, codes[name] = run(1 + round_)
            timing.sync()
            seconds[name].append(time.perf_counter() - t0)
            forwards[name].append(count)
    costs = {name: {"image_s": statistics.median(seconds[name]),
                    "ms_per_iteration": sum(seconds[name]) / sum(forwards[name]) * 1e3,
                    "target_forwards": statistics.mean(forwards[name])} for name in runs}
    return costs, codes
