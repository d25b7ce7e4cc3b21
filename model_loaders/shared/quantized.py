"""8-bit weights: the linear layers of a model's repeated blocks (attention and MLP, the layers that hold nearly all
of a transformer's weights and that every decode step reads) stored in 8 bits with one fp32 scale per output
channel, quantised at load from the checkpoint's own weights.

``int8``: symmetric, ``round(w / s)`` in [-127, 127] with ``s = max|row| / 127`` (gpt-fast's weight-only int8).
``fp8``: float8 e4m3fn, ``w / s`` with ``s = max|row| / 448`` (ComfyUI's 8-bit weight dtype, with a per-channel
scale). Embeddings, norms, logits heads and diffusion heads stay in the compute dtype: they are a small share of
the bytes, and the heads decide every sampled token.

Decoding at batch 1-2 is bound by memory bandwidth, so halving the bytes a step reads can speed it up, but only
where the matmul reads the codes themselves: on a GPU in half precision a Triton kernel does (w8_matmul.py);
elsewhere the weight is dequantised first, an extra pass over a dequantised copy of each weight. The layers keep
ComfyUI's low-VRAM protocol (``comfy_cast_weights``, streaming.py): a streamed 8-bit layer copies half the bytes
of a bf16 one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import FastARError
from .streaming import Streamable, StreamedLinear, make_streamable
from .w8_matmul import fused_matmul, fused_matmul_applies

WEIGHT_FORMATS = ("auto", "int8", "fp8")  # auto: the checkpoint's weights in the compute dtype
CODE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
CODE_PEAKS = {"int8": 127.0, "fp8": 448.0}  # the largest code each format stores (e4m3fn's largest finite value)
_TINY = 1e-12  # the scale of an all-zero row: its codes are zero whatever the scale


def check_weight_format(name: str) -> str:
    if name not in WEIGHT_FORMATS:
        raise FastARError(f"weight format {name!r} is not one of {', '.join(WEIGHT_FORMATS)} "
                          "(auto: the checkpoint's weights in the compute dtype)")
    return name


def quantize_rows(weight: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] as 8-bit codes and one fp32 scale per output channel (row):
    ``codes * scale[:, None]`` approximates ``weight``."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(_TINY) / CODE_PEAKS[fmt]
    scaled = w / scale[:, None]
    if fmt == "int8":
        return scaled.round().clamp(-127, 127).to(torch.int8), scale
    return scaled.clamp(-CODE_PEAKS[fmt], CODE_PEAKS[fmt]).to(CODE_DTYPES[fmt]), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.to(scale.dtype) * scale[:, None]).to(dtype)


class QuantizedLinear(nn.Module, Streamable):
    """A linear layer whose weight is 8-bit codes (``weight``) times an fp32 scale per output channel
    (``weight_scale``); the bias stays in the compute dtype. Moving the model (``.to(device, dtype)``) moves the
    codes and scales but never casts them: a cast would undo the quantisation, or round the scales."""

    def __init__(self, layer: nn.Linear, fmt: str):
        super().__init__()
        self.in_features, self.out_features, self.format = layer.in_features, layer.out_features, fmt
        codes, scale = quantize_rows(layer.weight, fmt)
        self.register_buffer("weight", codes.to(layer.weight.device))
        self.register_buffer("weight_scale", scale.to(layer.weight.device))
        self.bias = layer.bias

    def codes_for(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes and scales on ``x``'s device (copied there first when the layer streams)."""
        if self.comfy_cast_weights:
            return self.weight.to(x.device, non_blocking=True), self.weight_scale.to(x.device, non_blocking=True)
        return self.weight, self.weight_scale

    def weight_for(self, x: torch.Tensor) -> torch.Tensor:
        """The weight dequantised into ``x``'s dtype on its device."""
        return dequantize(*self.codes_for(x), x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.device, non_blocking=True)
        codes, scale = self.codes_for(x)
        if fused_matmul_applies(x, codes):  # a GPU in half precision: the codes read once, never dequantised
            return fused_matmul(x, codes, scale, bias)
        return F.linear(x, dequantize(codes, scale, x.dtype), bias)

    def _apply(self, fn, recurse=True):
        kept = {name: self._buffers.pop(name) for name in ("weight", "weight_scale")}
        try:
            super()._apply(fn, recurse)  # the bias, in the compute dtype
        finally:
            for name, tensor in kept.items():  # fn applied to an empty tensor says where it moves things
                self._buffers[name] = tensor.to(fn(torch.empty(0, dtype=tensor.dtype, device=tensor.device)).device)
        return self

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}"


def quantize_weights(model: nn.Module, fmt: str) -> nn.Module:
    """``model``'s block linear layers (those streaming.py streams) replaced, in place, by 8-bit ones; ``auto``
    leaves the model as it is."""
    if check_weight_format(fmt) == "auto":
        return model
    targets = {id(layer) for layer in make_streamable(model).modules() if isinstance(layer, StreamedLinear)}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in targets:
                setattr(parent, name, QuantizedLinear(child, fmt))
    return model


def weight_format(model: nn.Module) -> str:
    """The format ``model``'s blocks are stored in: ``int8``, ``fp8``, or ``auto`` (unquantised)."""
    return next((m.format for m in model.modules() if isinstance(m, QuantizedLinear)), "auto")
