"""Counting host syncs on a CPU: the tensor operations that make a GPU wait (a value read to Python, a tensor made
from Python data, a shape that depends on values). torch.cuda.set_sync_debug_mode counts them on a GPU only; this
sees the same calls on any device, so CI keeps each decoder to its budget."""
from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero", "tensor",
         "as_tensor", "unique", "masked_select", "argwhere"}


def value_dependent_index(args) -> bool:
    index = args[1] if len(args) > 1 else None
    parts = index if isinstance(index, tuple) else (index,)
    return any(torch.is_tensor(i) and i.dtype == torch.bool for i in parts)


class HostSyncs(TorchFunctionMode):
    """``with HostSyncs() as syncs: ...`` then ``syncs.total`` and ``syncs.calls`` (by operation)."""

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS or (name == "__getitem__" and value_dependent_index(args)):
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.calls.values())
