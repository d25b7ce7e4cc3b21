"""Cancelling a run where the decode loop's own callback cannot: inside MAR's diffusion steps, and while a first
``torch.compile`` runs. The caller that can cancel (ComfyUI's Cancel button, through the nodes) registers its
check for the length of a run; the layers below call ``check_interrupt()`` and know nothing of ComfyUI.
Without a registered check (the command line) nothing is checked and nothing changes."""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator

_CHECK: ContextVar[Callable[[], None] | None] = ContextVar("fastar_interrupt_check", default=None)


@contextmanager
def interruptible(check: Callable[[], None]) -> Iterator[None]:
    """Within the block, ``check_interrupt()`` calls ``check``, which raises to cancel the run."""
    token = _CHECK.set(check)
    try:
        yield
    finally:
        _CHECK.reset(token)


def can_interrupt() -> bool:
    return _CHECK.get() is not None


def check_interrupt() -> None:
    check = _CHECK.get()
    if check is not None:
        check()
