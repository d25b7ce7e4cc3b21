"""Counting host syncs on a CPU: the tensor operations that make a GPU wait (a value read to Python, a tensor made
from Python data, a number written through a tensor index, a shape that depends on values, a numpy array copied to
the device without ``non_blocking``). torch.cuda.set_sync_debug_mode counts them on a GPU only; this
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


def names_a_device(args, kwargs) -> bool:
    return "device" in kwargs or any(isinstance(a, (str, torch.device)) for a in args[1:])


def scalar_through_tensor_index(args) -> bool:
    """``t[index_tensor] = 3``: the number becomes a host tensor copied to the device (a sync there)."""
    return (len(args) > 2 and isinstance(args[2], (bool, int, float))
            and any(torch.is_tensor(i) for i in index_parts(args)))


class HostSyncs(TorchFunctionMode):
    """``with HostSyncs() as syncs: ...`` then ``syncs.total`` and ``syncs.calls`` (by operation)."""

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()
        self._from_numpy = torch.from_numpy

    def __enter__(self):
        def from_numpy(array):
            tensor = self._from_numpy(array)
            tensor.from_host_array = True  # host memory, whatever device the test runs on
            return tensor

        torch.from_numpy = from_numpy
        return super().__enter__()

    def __exit__(self, *exc):
        torch.from_numpy = self._from_numpy
        return super().__exit__(*exc)

    def blocking_upload(self, args, kwargs) -> bool:
        """``torch.from_numpy(a).to(device)``: on a GPU a copy the host waits for (``non_blocking`` from pinned
        memory does not wait)."""
        return (getattr(args[0], "from_host_array", False) and names_a_device(args, kwargs)
                and not kwargs.get("non_blocking", False))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if (name in READS or (name == "__getitem__" and value_dependent_index(args))
                or (name == "__setitem__" and scalar_through_tensor_index(args))
                or (name == "to" and self.blocking_upload(args, kwargs or {}))):
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.calls.values())
