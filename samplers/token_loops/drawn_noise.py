"""Random numbers drawn before a compiled loop step runs, in the order the step asks for them.

Dynamo cannot draw from a ``torch.Generator`` inside a graph (the call breaks it), yet a seed must give the same
image whether a loop step runs compiled or eagerly. What a step draws does not depend on its data (the window
fixes every shape), so its first run is eager and records what it drew (``Recording``); before every later run
the same draws are made from the generator in the same order (``draw``), and the step takes them in turn from
``Drawn``. Same calls in the same order: the same numbers as drawing in place, on the CPU and on CUDA.
"""
from __future__ import annotations

import torch

from ...errors import FastARError


class Recording:
    """Draws from ``generator`` in place, noting each call (kind, shape, range) for ``draw`` to repeat."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator
        self.calls: list[tuple] = []

    def rand(self, shape) -> torch.Tensor:
        self.calls.append(("rand", tuple(shape), None))
        return torch.rand(shape, generator=self.generator, device=self.generator.device)

    def randint(self, high: int, shape) -> torch.Tensor:
        self.calls.append(("randint", tuple(shape), high))
        return torch.randint(high, shape, generator=self.generator, device=self.generator.device)


def draw(calls: list[tuple], generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """The recorded ``calls`` made again from ``generator``, in order."""
    device = generator.device
    return tuple(torch.rand(shape, generator=generator, device=device) if kind == "rand"
                 else torch.randint(high, shape, generator=generator, device=device)
                 for kind, shape, high in calls)


class Drawn:
    """A step's draws, handed out in the order they were made; a call that does not match what was recorded is
    a mistake in the step (its draws depend on data), never silently other numbers."""

    def __init__(self, draws):
        self.draws, self.used = draws, 0

    def rand(self, shape) -> torch.Tensor:
        return self.take(shape, floating=True)

    def randint(self, high: int, shape) -> torch.Tensor:
        return self.take(shape, floating=False)

    def take(self, shape, floating: bool) -> torch.Tensor:
        drawn = self.draws[self.used] if self.used < len(self.draws) else None
        if drawn is None or tuple(drawn.shape) != tuple(shape) or drawn.is_floating_point() != floating:
            raise FastARError(f"a compiled loop step asked for random numbers of shape {tuple(shape)} as draw "
                              f"{self.used}, which its first run did not draw: its draws must not depend on data")
        self.used += 1
        return drawn

    def check_all_used(self) -> None:
        if self.used != len(self.draws):
            raise FastARError(f"a compiled loop step used {self.used} of the {len(self.draws)} draws its first run "
                              "made: its draws must not depend on data")
