"""8-bit weights: the linear layers of a model's repeated blocks (attention and MLP, the layers that hold nearly all
of a transformer's weights and that every decode step reads) stored in 8 bits with one fp32 scale per output
channel, quantised at load from the checkpoint's own weights.

``int8``: symmetric, ``round(w / s)`` in [-127, 127] with ``s = max|row| / 127`` (gpt-fast's weight-only int8).
``fp8``: float8 e4m3fn, ``w / s`` with ``s = max|row| / 448`` (ComfyUI's 8-bit weight dtype, with a per-channel
scale). Embeddings, norms, logits heads and diffusion heads stay in the compute dtype: they are a small share of
the bytes, and the heads decide every sampled token.

Decoding at batch 1-2 is bound by memory bandwidth, so halving the bytes a step reads can speed it up, but only
where the matmul reads the codes themselves: on a GPU in half precision a Triton kernel does (w8_matmul.py), and
on an AVX-512 CPU in bf16 torch's weight-only int8 kernel does for a decode step's few rows. Elsewhere the codes
are widened first. On the CPU they are copied into one buffer the model's 8-bit layers share (a fresh
weight-sized tensor per call costs more than the matmul: the host maps and faults in its pages every time) and
the output is scaled after the product. The layers keep ComfyUI's low-VRAM protocol (``comfy_cast_weights``,
streaming.py): a streamed 8-bit layer copies half the bytes of a bf16 one.
"""
from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import FastARError
from .streaming import Streamable, StreamedLinear, make_streamable
from .kernels.w8_matmul import fused_matmul, fused_matmul_applies

WEIGHT_FORMATS = ("auto", "int8", "fp8")  # auto: the checkpoint's weights in the compute dtype
CODE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
CODE_PEAKS = {"int8": 127.0, "fp8": 448.0}  # the largest code each format stores (e4m3fn's largest finite value)
_TINY = 1e-12  # the scale of an all-zero row: its codes are zero whatever the scale
QUANTISED_ROWS = 1024  # rows quantised at once
PACKED_ROWS = 8  # up to this many rows torch's int8 kernel beats widening the codes (this 2-core AVX-512 CPU, bf16)
_CPU_INT8_KERNEL = (torch.backends.cpu.get_cpu_capability().startswith("AVX512")  # where that kernel was measured
                    and hasattr(torch, "_weight_int8pack_mm"))  # a private op: gone in some torch, the buffer path runs


def check_weight_format(name: str) -> str:
    if name not in WEIGHT_FORMATS:
        raise FastARError(f"weight format {name!r} is not one of {', '.join(WEIGHT_FORMATS)} "
                          "(auto: the checkpoint's weights in the compute dtype)")
    return name


STORED_FORMAT = "fastar_weights"  # the metadata entry of a pre-quantised checkpoint (commands/quantize.py): its format


def format_to_load(metadata: dict, asked: str, source: str) -> str:
    """The format a checkpoint loads in: a pre-quantised one's own (what ``auto`` gives it; the other 8-bit format
    is refused, since codes cannot become the other format's without the full-precision weights), else ``asked``."""
    check_weight_format(asked)
    stored = metadata.get(STORED_FORMAT)
    if stored is None:
        return asked
    if stored not in CODE_DTYPES:
        raise FastARError(f"{source}: its {STORED_FORMAT} metadata says {stored!r}, which is neither int8 nor fp8: "
                          "the file was not written by this FastAR; write it again with python -m fastar quantize")
    if asked not in ("auto", stored):
        raise FastARError(f"{source} holds {stored} weights (written by python -m fastar quantize): load it with "
                          f"weight_dtype auto or {stored}; for {asked}, quantise the full-precision checkpoint")
    return stored


def quantize_rows(weight: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] as 8-bit codes and one fp32 scale per output channel (row):
    ``codes * scale[:, None]`` approximates ``weight``. A few rows at a time: the fp32 temporaries of a whole 7B
    layer would be several copies of 360 MB."""
    codes = torch.empty(weight.shape, dtype=CODE_DTYPES[fmt], device=weight.device)
    scale = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for start in range(0, weight.shape[0], QUANTISED_ROWS):
        rows = slice(start, start + QUANTISED_ROWS)
        w = weight[rows].detach().float()
        scale[rows] = w.abs().amax(dim=1).clamp_min(_TINY) / CODE_PEAKS[fmt]
        scaled = w / scale[rows, None]
        codes[rows] = scaled.round().clamp(-127, 127) if fmt == "int8" else scaled.clamp(-CODE_PEAKS[fmt], CODE_PEAKS[fmt])
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.to(scale.dtype) * scale[:, None]).to(dtype)


def scaled_product(x: torch.Tensor, widened: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` times the codes ``widened`` to its dtype, then each output channel times its scale (a scale per output
    channel can follow the product), in ``x``'s dtype."""
    return (F.linear(x, widened) * scale).to(x.dtype)


def packed_int8_applies(x: torch.Tensor, codes: torch.Tensor) -> bool:
    """Whether torch's CPU weight-only int8 kernel takes this product: bf16 on an AVX-512 CPU, at most PACKED_ROWS
    rows, inputs a multiple of 16 wide (narrower multiples gave wrong products, odd widths crashed: torch 2.13)."""
    return (x.device.type == "cpu" and x.dtype == torch.bfloat16 and codes.dtype == torch.int8
            and x.numel() // x.shape[-1] <= PACKED_ROWS and codes.shape[1] % 16 == 0 and _CPU_INT8_KERNEL)


def packed_int8_product(x: torch.Tensor, codes: torch.Tensor, bf16_scale: torch.Tensor) -> torch.Tensor:
    """``x`` times the int8 codes and their bf16 scales through torch's weight-only int8 kernel. Inside a compiled
    step the product is written as gpt-fast's (codes cast to bf16, product, times the scales), which inductor
    replaces by that kernel where it matches its pattern: an input of three dimensions, scales a bf16 tensor it is
    given (a scale cast inside the graph made its lowering fail)."""
    if torch.compiler.is_compiling():
        rows = x if x.dim() == 3 else x.reshape(1, -1, x.shape[-1])
        return (F.linear(rows, codes.to(x.dtype)) * bf16_scale).reshape(*x.shape[:-1], -1)
    return torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), codes, bf16_scale).reshape(*x.shape[:-1], -1)


class WidenedCodes:
    """The one buffer a model's 8-bit layers widen their codes into on the CPU, each in turn (a model runs one
    forward at a time), grown to the largest layer: a layer's weight in the compute dtype, held with the model."""

    def __init__(self):
        self.flat: dict[torch.dtype, torch.Tensor] = {}

    def of(self, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``codes`` widened to ``dtype`` (exact: every 8-bit code is a bf16, fp16 and fp32 number)."""
        size = codes.numel()
        if torch.compiler.is_compiling():  # a compiled step makes its own buffers
            return codes.to(dtype)
        if dtype not in self.flat or self.flat[dtype].numel() < size:
            self.flat.pop(dtype, None)  # free the smaller one first
            self.flat[dtype] = torch.empty(size, dtype=dtype)
        return self.flat[dtype][:size].view(codes.shape).copy_(codes)


class QuantizedLinear(nn.Module, Streamable):
    """A linear layer whose weight is 8-bit codes (``weight``) times an fp32 scale per output channel
    (``weight_scale``); the bias stays in the compute dtype. Moving the model (``.to(device, dtype)``) moves the
    codes and scales but never casts them: a cast would undo the quantisation, or round the scales. On the CPU
    the layer also keeps its scales rounded to bf16 (``bf16_scale``, what torch's int8 kernel takes; not a buffer:
    made from ``weight_scale`` whenever that is set or moved, and neither saved nor counted in the model's size).
    ``widened`` is the CPU buffer the layer shares with the model's other 8-bit layers (its own if not given)."""

    def __init__(self, layer: nn.Linear, fmt: str, widened: WidenedCodes | None = None):
        super().__init__()
        self.in_features, self.out_features, self.format = layer.in_features, layer.out_features, fmt
        codes, scale = quantize_rows(layer.weight, fmt)
        self.register_buffer("weight", codes.to(layer.weight.device))
        self.register_buffer("weight_scale", scale.to(layer.weight.device))
        self.bias = layer.bias
        self.widened = widened or WidenedCodes()
        self.round_scales()

    def round_scales(self) -> None:
        scale = self.weight_scale
        self.bf16_scale = scale.to(torch.bfloat16) if scale.device.type == "cpu" else None

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
        if x.device.type != "cpu" or x.dtype == torch.float16:  # fp16: a product of unscaled codes could overflow
            return F.linear(x, dequantize(codes, scale, x.dtype), bias)
        if packed_int8_applies(x, codes):
            out = packed_int8_product(x, codes, self.bf16_scale)
        else:
            out = scaled_product(x, self.widened.of(codes, x.dtype), scale)
        return out if bias is None else out + bias

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if prefix + "weight_scale" in state_dict:
            self.round_scales()

    def _apply(self, fn, recurse=True):
        kept = {name: self._buffers.pop(name) for name in ("weight", "weight_scale")}
        try:
            super()._apply(fn, recurse)  # the bias, in the compute dtype
        finally:
            for name, tensor in kept.items():  # fn applied to an empty tensor says where it moves things
                self._buffers[name] = tensor.to(fn(torch.empty(0, dtype=tensor.dtype, device=tensor.device)).device)
            self.round_scales()
        return self

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}"


def quantize_weights(model: nn.Module, fmt: str) -> nn.Module:
    """``model``'s block linear layers (those streaming.py streams) replaced, in place, by 8-bit ones; ``auto``
    leaves the model as it is."""
    if check_weight_format(fmt) == "auto":
        return model
    targets = {id(layer) for layer in make_streamable(model).modules() if isinstance(layer, StreamedLinear)}
    widened = WidenedCodes()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in targets:
                setattr(parent, name, QuantizedLinear(child, fmt, widened))
    return model


def weight_format(model: nn.Module) -> str:
    """The format ``model``'s blocks are stored in: ``int8``, ``fp8``, or ``auto`` (unquantised)."""
    return next((m.format for m in model.modules() if isinstance(m, QuantizedLinear)), "auto")


_loading: contextvars.ContextVar[tuple[str, torch.dtype | None] | None] = contextvars.ContextVar(
    "fastar_quantised_loading", default=None)


@contextlib.contextmanager
def quantised_loading(fmt: str, dtype: torch.dtype | None):
    """Models loaded inside (checkpoint.load_weights) get their blocks' layers in 8 bits as each weight is read,
    quantised from it cast to ``dtype`` (what quantising the loaded model would read): host memory holds the 8-bit
    model and a layer or two, never the whole model in full precision (14 GB for a 7B model in bf16)."""
    token = _loading.set((check_weight_format(fmt), dtype))
    try:
        yield
    finally:
        _loading.reset(token)


def stored_format_loading(metadata: dict, asked: str, source: str, dtype: torch.dtype | None):
    """``quantised_loading`` in the format a checkpoint loads in (``format_to_load``): for loaders that hand a read
    checkpoint to a family's loader (drafters)."""
    return quantised_loading(format_to_load(metadata, asked, source), dtype)


class LoadQuantiser:
    """The 8-bit layers of a model loading inside ``quantised_loading``: the keys of their weights, and the codes
    and scales of each from the checkpoint's tensor."""

    def __init__(self, model: nn.Module, fmt: str, dtype: torch.dtype | None):
        quantize_weights(model, fmt)  # on the meta device: the layers' structure, their codes still to come
        self.fmt, self.dtype = fmt, dtype
        self.weights = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
        self.scales = {f"{key}_scale" for key in self.weights}

    def state(self, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """What the model takes for checkpoint tensor ``key``: codes and scales for an 8-bit layer's weight (codes
        already, in a pre-quantised file: as they are, their scales stored beside them)."""
        if key not in self.weights or tensor.dtype == CODE_DTYPES[self.fmt]:
            return {key: tensor}
        if is_codes(tensor):
            raise FastARError(f"{key} holds {tensor.dtype} codes, not {self.fmt}: load the file in its own format")
        codes, scale = quantize_rows(tensor if self.dtype is None else tensor.to(self.dtype), self.fmt)
        return {key: codes, f"{key}_scale": scale}


def is_codes(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds 8-bit codes (a pre-quantised checkpoint's), which no cast may touch."""
    return tensor.dtype in CODE_DTYPES.values()


def loading_state(quantiser: LoadQuantiser | None, tensors) -> dict[str, torch.Tensor]:
    """What a loading model takes for the checkpoint's ``tensors`` ((key, tensor) pairs): with a quantiser, its
    8-bit layers' weights as codes and scales; else the tensors as they are."""
    if quantiser is None:
        return dict(tensors)
    return {k: t for key, tensor in tensors for k, t in quantiser.state(key, tensor).items()}


def load_quantiser(model: nn.Module, dtype: torch.dtype | None = None) -> LoadQuantiser | None:
    """The quantiser of ``model`` (about to load) inside ``quantised_loading``; ``dtype``: the precision its
    weights are quantised from, if not the one ``quantised_loading`` was given."""
    loading = _loading.get()
    if loading is None or loading[0] == "auto":
        return None
    return LoadQuantiser(model, loading[0], dtype or loading[1])


def quantised_state(model: nn.Module, sd: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """``sd`` as ``model`` takes it inside ``quantised_loading`` (its 8-bit layers' weights as codes and scales,
    quantised from ``dtype``), else unchanged: for a loader that loads part of a model again (MAR's fp32 head)."""
    return loading_state(load_quantiser(model, dtype), sd.items())
