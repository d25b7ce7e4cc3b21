"""A decoder iteration's work after its forward (sampling, verification, the next drafts) as one compiled step.

Eagerly that work is dozens of small ops per iteration, each a kernel launch and a Python dispatch: about 1 ms
of a compiled SJD iteration at the demo's shape on a 2-core CPU, and on a GPU dozens of small kernels after every
forward. Where the model's own steps are compiled (compiled.py), the work runs through
torch.compile too, without CUDA graphs (it updates the generation's token buffers in place, which a graph could
only do at fixed addresses). Its random numbers are drawn eagerly beforehand (drawn_noise.py), so a seed gives
the same draws either way. Elsewhere it runs eagerly, drawing in place, exactly as before.
"""
from __future__ import annotations

import contextlib
import contextvars
import weakref

from ...model_loaders.shared.compiled import BoundStep, compiled_function, following_mode
from .drawn_noise import Drawn, Recording, draw

_compiling: contextvars.ContextVar[bool] = contextvars.ContextVar("fastar_compiled_loop_steps", default=True)


@contextlib.contextmanager
def eager_loop_steps():
    """Loop steps made inside run eagerly whatever the model's steps do (the profile times what compiling saves)."""
    token = _compiling.set(False)
    try:
        yield
    finally:
        _compiling.reset(token)


def run_drawn(work, draws: int, *args):
    """``work.body`` on the tensors ``args[draws:]`` with the random numbers ``args[:draws]``."""
    noise = Drawn(args[:draws])
    result = work.body(noise, *args[draws:])
    noise.check_all_used()
    return result


def compiled_loop_step(mode: str):
    """The one compiled function every loop step runs through in ``mode``: dynamic where calls differ, so that a
    slider's new value (a cfg scale, a temperature, GSD's thresholds, LANTERN's delta) reuses its graph."""
    return compiled_function(run_drawn, mode, dynamic=None)


class LoopStep:
    """Calls ``work.body(noise, *tensors)`` (returning tensors) once per iteration of one generation, with
    ``generator``'s numbers: compiled while ``session``'s forward runs compiled (not where it fell back to eager:
    a machine that cannot compile says so once), eagerly otherwise. ``work`` holds what stays put for the
    generation (rule, settings, buffers): it is the compiled step's state."""

    def __init__(self, work, session, generator):
        self.work, self.generator, self.calls, self.compiled = work, generator, None, None
        self.forward = getattr(session, "forward", None) if _compiling.get() else None

    def __call__(self, *tensors):
        mode = following_mode(self.forward)
        if mode is None:
            return self.work.body(self.generator, *tensors)
        if self.calls is None:  # the first iteration runs eagerly and notes what it draws
            recording = Recording(self.generator)
            result = self.work.body(recording, *tensors)
            self.calls = recording.calls
            return result
        if self.compiled is None:  # one for the generation: its repeated calls skip dynamo's full guards
            step = compiled_loop_step(mode)
            self.compiled = BoundStep(step, weakref.ref(self.work))
        draws = draw(self.calls, self.generator)
        return self.compiled(len(draws), *draws, *tensors)
