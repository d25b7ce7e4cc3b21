"""Projections of one input stored as one layer: a LLaMA-family block's q, k and v, and its MLP's gate and up.

One matmul instead of three (or two) reads the same bytes in fewer, bigger kernels: on a GPU each kernel of a
decode step costs its launch gap and its ramp, whatever its size. Checkpoints (the official releases, Hugging
Face's layout) keep the parts apart, so a joined layer is filled from its parts as a model loads (``JoinedWeights``)
and split into them again where FastAR writes a checkpoint or hands weights to another library
(``parted_state_dict``). A module declares its joined layers in ``joined``: ``{layer name: ((part name, output
rows), ...)}``, the parts in the order their rows are stacked; a joined layer's bias is joined as its weight is.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn


def joined_parts(model: nn.Module) -> dict[str, tuple[tuple[str, int], ...]]:
    """The state-dict key of every joined weight (and bias) in ``model`` -> the keys of its parts and their output
    rows."""
    parts = {}
    for prefix, module in model.named_modules():
        pre = f"{prefix}." if prefix else ""
        for layer, pieces in getattr(module, "joined", {}).items():
            for tensor in ("weight", "bias", "weight_scale"):  # an 8-bit layer's scales too (quantized.py)
                if getattr(getattr(module, layer), tensor, None) is not None:
                    parts[f"{pre}{layer}.{tensor}"] = tuple((f"{pre}{name}.{tensor}", rows) for name, rows in pieces)
    return parts


class JoinedWeights(Mapping):
    """A checkpoint's tensors (a dict, or shards read on demand) with the parts of each joined weight read as one,
    stacked on the output rows; a joined weight stored whole (a FastAR file) is read as it is."""

    def __init__(self, sd: Mapping, parts: dict[str, tuple[tuple[str, int], ...]]):
        self.sd = sd
        self.parts = {key: tuple(name for name, _ in pieces) for key, pieces in parts.items()
                      if key not in sd and all(name in sd for name, _ in pieces)}
        self.stacked = {name for names in self.parts.values() for name in names}
        self.names = [k for k in sd if k not in self.stacked] + list(self.parts)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.parts:
            return torch.cat([self.sd[name] for name in self.parts[key]])
        return self.sd[key]

    def shape(self, key: str) -> tuple[int, ...]:
        """Without reading shards (as checkpoint.shape_of, which reads checkpoints through this view: no import)."""
        stored = getattr(self.sd, "shape", lambda name: tuple(self.sd[name].shape))
        if key not in self.parts:
            return stored(key)
        shapes = [stored(name) for name in self.parts[key]]
        return (sum(s[0] for s in shapes), *shapes[0][1:])

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, key) -> bool:
        return key in self.parts or (key in self.sd and key not in self.stacked)


def missing_parts(key: str, sd: Mapping, parts: dict[str, tuple[tuple[str, int], ...]]) -> list[str]:
    """What a checkpoint lacks for the model's weight ``key``: the parts it lacks where ``key`` is joined."""
    if key not in parts:
        return [key]
    return [name for name, _ in parts[key] if name not in sd]


def stored_shapes(key: str, shape: tuple[int, ...], sd: Mapping,
                  parts: dict[str, tuple[tuple[str, int], ...]]) -> list[tuple[str, tuple[int, ...]]]:
    """What checkpoint ``sd`` stores of the model's weight ``key`` of ``shape``, and the shape each must have: where
    ``key`` is joined and stored in parts, every part with its rows, so that a message names the file's own keys."""
    if key not in parts or key in sd:
        return [(key, shape)]
    return [(name, (rows, *shape[1:])) for name, rows in parts[key]]


def parted_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every joined weight split into its parts, where it was: the checkpoints' own
    layout."""
    return parted(model.state_dict(), joined_parts(model))


def parted(state: Mapping[str, torch.Tensor], parts: dict[str, tuple[tuple[str, int], ...]]) -> dict[str, torch.Tensor]:
    """``state`` (a model's keys) with each joined tensor of ``parts`` (``joined_parts``) split into its parts."""
    out = {}
    for key, tensor in state.items():
        if key not in parts:
            out[key] = tensor
            continue
        for (name, _), part in zip(parts[key], tensor.split([rows for _, rows in parts[key]])):
            out[name] = part
    return out
