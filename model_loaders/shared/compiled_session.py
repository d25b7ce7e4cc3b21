"""What a session does differently while a compiled model starts it (compiled.py): shapes that stay put.

- Caches that keep their addresses from one generation to the next (CUDA graphs). A CUDA graph reads and writes
  fixed addresses; inductor captures a step that writes its inputs (the KV caches) only where those inputs are
  static (``mark_static_address``), and a new cache per generation would make it re-record every time. So the
  n-th cache a session asks for is the n-th of the model's ``StaticBuffers``, zeroed, reused whenever shape,
  dtype and device match, replaced where they do not; only the last session's set is kept. One session per
  model at a time uses them (FastAR never runs two of one model at once; a drafter is another model).
- Prompt prefixes padded to a multiple of PREFIX_BUCKET slots, since a step is compiled for its prefix length:
  one compilation serves every prompt of similar length, not one per prompt.
- Caches of a multiple of SLOT_BUCKET slots: a session's scratch slots depend on its widest window (1 for `ar`,
  W for `sjd`), so without it decoders taking turns would each replace the other's buffers (and re-record).
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch

PREFIX_BUCKET = 32
SLOT_BUCKET = 64


@dataclass
class CompiledStart:
    buffers: "StaticBuffers | None"  # None: no CUDA graphs, caches as usual


_starting: contextvars.ContextVar[CompiledStart | None] = contextvars.ContextVar("fastar_compiled_start",
                                                                                  default=None)


@contextlib.contextmanager
def compiled_start(buffers: "StaticBuffers | None"):
    """Sessions made inside are a compiled model's: bucketed prefixes, caches from ``buffers`` if given."""
    token = _starting.set(CompiledStart(buffers))
    try:
        if buffers is None:
            yield
        else:
            with buffers.serving():
                yield
    finally:
        _starting.reset(token)


def padded_prefix_len(longest: int) -> int:
    """The prefix slots a session gives prompts whose longest takes ``longest`` (left padding, masked)."""
    if _starting.get() is None:
        return longest
    return -(-longest // PREFIX_BUCKET) * PREFIX_BUCKET


def padded_slots(slots: int) -> int:
    """The cache slots a session allocates when it needs ``slots`` (the extra ones are scratch, never seen)."""
    if _starting.get() is None:
        return slots
    return -(-slots // SLOT_BUCKET) * SLOT_BUCKET


def cache_zeros(*shape, dtype, device) -> torch.Tensor:
    """A zeroed KV-cache tensor: a reused static buffer while a CUDA-graph model starts a session, else new."""
    start = _starting.get()
    if start is not None and start.buffers is not None:
        return start.buffers.take(shape, dtype, torch.device(device))
    return torch.zeros(*shape, dtype=dtype, device=device)


class StaticBuffers:
    def __init__(self):
        self.buffers: list[torch.Tensor | None] = []
        self.taken = 0

    @contextlib.contextmanager
    def serving(self):
        """Caches made inside come from these buffers; those the session did not ask for are freed after."""
        self.taken = 0
        try:
            yield
        finally:
            del self.buffers[self.taken:]

    def take(self, shape, dtype, device) -> torch.Tensor:
        i, self.taken = self.taken, self.taken + 1
        if i < len(self.buffers):
            old = self.buffers[i]
            if old.shape == shape and old.dtype == dtype and old.device == device:
                return old.zero_()
            self.buffers[i] = None  # free the old one before the new one is made
        buffer = torch.zeros(*shape, dtype=dtype, device=device)
        torch._dynamo.mark_static_address(buffer)  # unguarded: a replaced buffer re-records, it does not recompile
        self.buffers[i:i + 1] = [buffer]
        return buffer

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers if b is not None)
