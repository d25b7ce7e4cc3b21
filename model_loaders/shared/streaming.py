"""Weights streamed from host memory: a model too big for its GPU keeps some of its blocks' linear layers in
(pinned) host memory and copies each one to the GPU as its forward runs. Slower, since those weights cross PCIe
at every step, but it runs where a full load cannot.

The switch is ComfyUI's own low-VRAM protocol, so that ComfyUI's memory management decides what stays on the
GPU: a module with a ``comfy_cast_weights`` attribute may be left in host memory by a partial load, which sets
the flag, and then brings its weights to its input's device itself. FastAR's models are plain PyTorch, so at
load the linear layers of their repeated blocks become StreamedLinear, which honours the flag; the CLI sets it
itself (place()). Only blocks stream: embeddings, heads and norms are small beside them, and some are read
outside their forward (the code embeddings, the device a model reports).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import FastARError

GB = 1e9
BUFFERED_LAYERS = 2  # streamed layers on the GPU at once at most: the running one and the next one's copy


class Streamable:
    """A block's linear layer that honours ComfyUI's ``comfy_cast_weights``: StreamedLinear, and its 8-bit form
    (quantized.py)."""

    comfy_cast_weights = False

    def weight_for(self, x: torch.Tensor) -> torch.Tensor:
        """The weight as applied to ``x``: on ``x``'s device (a streamed layer's copy), in the layer's compute
        dtype."""
        raise NotImplementedError


class StreamedLinear(nn.Linear, Streamable):
    """nn.Linear whose weights may stay in host memory (``comfy_cast_weights``), copied per call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.comfy_cast_weights:
            return super().forward(x)
        bias = None if self.bias is None else self.bias.to(x.device, non_blocking=True)
        return F.linear(x, self.weight_for(x), bias)

    def weight_for(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight.to(x.device, non_blocking=True) if self.comfy_cast_weights else self.weight


def make_streamable(model: nn.Module) -> nn.Module:
    """Turn the linear layers inside ``model``'s module lists (its transformer blocks) into StreamedLinear, in
    place. Same parameters and outputs: StreamedLinear adds behaviour only, so swapping the class is safe."""
    for blocks in [m for m in model.modules() if isinstance(m, nn.ModuleList)]:
        for layer in blocks.modules():
            if type(layer) is nn.Linear:
                layer.__class__ = StreamedLinear
    return model


def streamable_layers(model: nn.Module) -> list[Streamable]:
    return [m for m in model.modules() if isinstance(m, Streamable)]


def streamed_layers(model: nn.Module) -> list[Streamable]:
    """The layers whose weights are in host memory now (set by ComfyUI's partial load, or by place())."""
    return [m for m in streamable_layers(model) if m.comfy_cast_weights]


def is_streaming(model: nn.Module) -> bool:
    return any(m.comfy_cast_weights for m in streamable_layers(model))


def model_bytes(module: nn.Module) -> int:
    """Bytes of a model's or a layer's weights and buffers (an 8-bit layer's codes and scales are buffers)."""
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def streamed_bytes(model: nn.Module) -> int:
    """Bytes of weights copied from host memory at every forward."""
    return sum(model_bytes(m) for m in streamed_layers(model))


def streamable_bytes(model: nn.Module) -> int:
    return sum(model_bytes(m) for m in streamable_layers(model))


def stream_buffer_bytes(model: nn.Module) -> int:
    """Device memory streamed layers take at once while they run."""
    return BUFFERED_LAYERS * max((model_bytes(m) for m in streamable_layers(model)), default=0)


def resident_minimum(model: nn.Module) -> int:
    """The least device memory ``model``'s weights can run in: what never streams, plus the streaming buffer."""
    return model_bytes(model) - streamable_bytes(model) + stream_buffer_bytes(model)


def place(model: nn.Module, device: torch.device, resident: int, option: str = "--gpu-weights") -> int:
    """Move ``model`` (in host memory) to ``device`` keeping at most ``resident`` bytes of its weights there (0:
    only what cannot stream): the first blocks' layers until the budget is spent, the rest streamed from pinned
    host memory. Returns the bytes streamed. ``option`` names the setting that gave ``resident``, for the message
    when it is too small."""
    total, least = model_bytes(model), resident_minimum(model)
    resident = resident or least
    if resident < least and resident < total:
        raise FastARError(f"{option} {resident / GB:.2f} GB is less than this model needs on the GPU whatever "
                          f"streams ({least / GB:.2f} GB: embeddings, heads, norms and two streamed layers at a "
                          f"time): give at least {least / GB:.2f}, or 0 for just that")
    budget, keep = resident - least if resident < total else total, True
    for layer in streamable_layers(model):
        size = model_bytes(layer)
        keep = keep and size <= budget  # from the first layer that does not fit, all stream (in the order they run)
        budget -= size if keep else 0
        layer.comfy_cast_weights = not keep
        if not keep and device.type == "cuda":
            pin(layer)
    move_resident(model, device)
    return streamed_bytes(model)


def pin(layer: nn.Module) -> None:
    """Put ``layer``'s tensors in pinned host memory: their copies to the GPU then run without blocking the host."""
    for p in layer.parameters():
        p.data = p.data.pin_memory()
    for name, b in layer.named_buffers(recurse=False):
        setattr(layer, name, b.pin_memory())


def move_resident(model: nn.Module, device: torch.device) -> None:
    """Move every weight and buffer of ``model`` that does not stream to ``device`` (where it is not yet)."""
    for module in model.modules():
        if getattr(module, "comfy_cast_weights", False):
            continue
        for p in module.parameters(recurse=False):
            if p.device != device:
                p.data = p.data.to(device)
        for name, b in module.named_buffers(recurse=False):
            if b.device != device:
                setattr(module, name, b.to(device))
