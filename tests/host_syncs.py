"""Counting host syncs on a CPU: the tensor operations that make a GPU wait (a value read to Python, a tensor made
from Python data, a number written through a tensor index, a shape that depends on values). torch.cuda.set_sync_debug_mode counts them on a GPU only; this
sees the same calls on any device, so CI keeps each decoder to its budget."""
from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero", "tensor",
         "as_tensor", "unique", "masked_select", "argwhere"}


def index_parts(args) -> tuple:
    index = args[1] if len(args) > 1 else None
    return index if isinstance(index, tuple) else (index,)


def value_dependent_index(args) -> bool:
    return any(torch.is_tensor(i) and i.dtype == torch.bool for i in index_parts(args))


def scalar_through_tensor_index(args) -> bool:
    """``t[index_tensor] = 3``: the number becomes a host tensor copied to the device (a sync there)."""
    return (len(args) > 2 and isinstance(args[2], (bool, int, float))
            and any(torch.is_tensor(i) for i in index_parts(args)))


class HostSyncs(TorchFunctionMode):
    """``with HostSyncs() as syncs: ...`` then ``syncs.total`` and ``syncs.calls`` (by operation)."""

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if (name in READS or (name == "__getitem__" and value_dependent_index(args))
                or (name == "__setitem__" and scalar_through_tensor_index(args))):
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.calls.values())
