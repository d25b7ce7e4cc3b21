"""ComfyUI services for FastAR models: memory management, devices and dtypes, interruption, progress with
a live preview. Newer-only ComfyUI APIs are feature-detected; everything here works on 0.3.75."""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager

import numpy as np
import torch
from PIL import Image

import comfy.model_management as mm
import comfy.model_patcher
import comfy.utils

from ..interrupts import interruptible
from ..memory import Need, check_room as refuse_unless_room
from ..model_loaders.shared.compiled import release_static_buffers
from ..model_loaders.shared.streaming import (move_resident, stream_buffer_bytes, streamable_bytes, streamable_layers,
                                       streamed_bytes)
from ..pipeline import DTYPES

try:
    from comfy.patcher_extension import CallbacksMP
except ImportError:  # a ComfyUI before patcher callbacks
    CallbacksMP = None

DTYPE_CHOICES = ("auto", *DTYPES)


class Holder(torch.nn.Module):
    """What a ModelPatcher manages. The patcher sets ``.device`` on its module; FastAR models expose
    ``device`` as a read-only property, so they travel inside this holder."""

    def __init__(self, inner: torch.nn.Module, device: torch.device):
        super().__init__()
        self.inner = inner
        self.device = device


def load_device() -> torch.device:
    return mm.get_torch_device()


def offload_device() -> torch.device:
    return mm.unet_offload_device()


def choose_dtype(name: str, device: torch.device, *, for_vq: bool = False) -> torch.dtype:
    """``auto``: ComfyUI's choice for the device (bf16 where it is fast, else fp16 on GPUs, fp32 on CPU)."""
    if name != "auto":
        return DTYPES[name]
    if for_vq and hasattr(mm, "vae_dtype"):
        return mm.vae_dtype(device)
    if mm.should_use_bf16(device):
        return torch.bfloat16
    if mm.should_use_fp16(device):
        return torch.float16
    return torch.float32


def make_patcher(module: torch.nn.Module):
    """Wrap a FastAR model so ComfyUI can load it to the GPU and offload it. ``CoreModelPatcher`` is
    looked up now (ComfyUI may swap it at start-up); a dynamic-VRAM patcher, which streams weights
    only through comfy.ops layers, is replaced by the plain ModelPatcher (FastAR models are plain
    PyTorch)."""
    holder = Holder(module, next(module.parameters()).device)
    plain = comfy.model_patcher.ModelPatcher
    patcher_class = getattr(comfy.model_patcher, "CoreModelPatcher", plain)
    patcher = patcher_class(holder, load_device=load_device(), offload_device=offload_device())
    is_dynamic = getattr(patcher, "is_dynamic", None)
    if patcher_class is not plain and callable(is_dynamic) and is_dynamic():
        patcher = plain(holder, load_device=load_device(), offload_device=offload_device())
    if CallbacksMP is not None and hasattr(patcher, "add_callback"):  # offloaded: the CUDA-graph caches go too
        patcher.add_callback(CallbacksMP.ON_DETACH, lambda *_: release_static_buffers(module))
    return patcher


def check_room(named_patchers: list, working, images: int, dtype: torch.dtype) -> None:
    """Refuse a run that cannot fit the GPU even with every other model offloaded and the blocks that can
    stream left in system memory, saying what would fit (memory.check_room); ``named_patchers``: (model name,
    patcher) pairs; ``working``: images -> bytes."""
    device = load_device()
    if device.type != "cuda":
        return
    weights: dict = {}
    for name, patcher in named_patchers:  # a model folder holding its VQ gives both the same name
        weights[name] = weights.get(name, 0) + patcher.model_size()
    models = [patcher.model.inner for _, patcher in named_patchers]
    need = Need(weights, working, images, streamable=sum(streamable_bytes(m) for m in models),
                stream_buffer=max(stream_buffer_bytes(m) for m in models))
    refuse_unless_room(need, mm.get_total_memory(device), f"the GPU ({torch.cuda.get_device_name(device)})",
                       dtype=dtype)


def load_checked(named_patchers: list, working, images: int, dtype: torch.dtype) -> None:
    """check_room, then load_for_inference with what ``images`` at once need beyond the weights."""
    check_room(named_patchers, working, images, dtype)
    load_for_inference([patcher for _, patcher in named_patchers], working(images))
    for name, patcher in named_patchers:
        streamed = streamed_bytes(patcher.model.inner)
        if streamed:
            logging.info(f"FastAR: {streamed / 1e9:.1f} GB of {name}'s weights stay in system memory and stream to "
                         "the GPU at every step (slower, compiled steps off); free GPU memory (other models, a "
                         "smaller batch) to run it at full speed")


def load_for_inference(patchers: list, memory_required: int) -> None:
    """Make room (offloading other models), load the patchers' models to their load device and reserve
    ``memory_required`` bytes (KV cache and activations) on top. A model with blocks that can stream is loaded
    the way ComfyUI loads its own models: partially where the GPU is short, the rest streamed
    (model_loaders/shared/streaming.py); other models are loaded fully."""
    streams = any(streamable_layers(patcher.model.inner) for patcher in patchers)
    try:
        mm.load_models_gpu(patchers, memory_required=memory_required, force_full_load=not streams)
    except TypeError:  # a ComfyUI without force_full_load
        mm.load_models_gpu(patchers, memory_required=memory_required)
    for patcher in patchers:  # layers that do not stream cannot stay behind: a partial load must include them
        move_resident(patcher.model.inner, patcher.load_device)


def make_room(nbytes: int) -> None:
    """Offload other models until ``nbytes`` fit on the load device (for models ComfyUI does not manage,
    such as the T5 text encoder that is used once and dropped)."""
    mm.free_memory(nbytes, load_device())


def free_cache() -> None:
    mm.soft_empty_cache()


@contextmanager
def decoding():
    """Around a decode: Cancel is honoured inside long stretches without an iteration boundary too (MAR's
    diffusion steps, a first torch.compile), and the cache is freed after it, cancelled or not."""
    try:
        with interruptible(mm.throw_exception_if_processing_interrupted):
            yield
    finally:
        free_cache()


def to_image_tensor(images: np.ndarray) -> torch.Tensor:
    """uint8 [B, H, W, 3] -> ComfyUI IMAGE: float32 [B, H, W, 3] in 0..1 on the intermediate device."""
    return torch.from_numpy(np.ascontiguousarray(images)).float().div(255.0).to(mm.intermediate_device())


def previews_enabled() -> bool:
    """Live previews follow ComfyUI's --preview-method: none (ComfyUI's default) turns them off."""
    try:
        from comfy.cli_args import LatentPreviewMethod, args
    except ImportError:
        return True
    return args.preview_method != LatentPreviewMethod.NoPreviews


def preview_size() -> int:
    try:
        from comfy.cli_args import args
        return int(args.preview_size)
    except (ImportError, AttributeError):
        return 512


def progress_text(text: str, node_id) -> None:
    """A line of text under the node while it runs (newer ComfyUI); silently nothing elsewhere."""
    try:
        from server import PromptServer
        send = getattr(PromptServer.instance, "send_progress_text", None)
    except (ImportError, AttributeError):
        return
    if send is not None and node_id is not None:
        send(text, node_id)


class DecodeProgress:
    """The ``on_iteration`` callback of a decode: honours Cancel within one iteration, drives the
    progress bar, and sends a live preview of the partly decoded image (throttled: a VQ decode costs,
    so previews take at most about a sixth of the time; the last one shows the finished image)."""

    MIN_UPDATE_S = 0.1
    FIRST_PREVIEW_S = 0.3
    MIN_PREVIEW_S = 0.5

    def __init__(self, node_id, total: int, label: str, preview=None):
        self.node_id, self.total, self.label, self.preview = node_id, total, label, preview
        self.bar = comfy.utils.ProgressBar(total, node_id=node_id)
        self.start = self.last_update = time.perf_counter()
        self.next_preview = self.start + self.FIRST_PREVIEW_S
        self.iterations = 0

    def __call__(self, done: int, total: int, tokens: torch.Tensor) -> None:
        mm.throw_exception_if_processing_interrupted()
        self.iterations += 1
        now = time.perf_counter()
        if now - self.last_update < self.MIN_UPDATE_S and done < total:
            return
        self.last_update = now
        image = None
        if self.preview is not None and (now >= self.next_preview or done >= total):
            image = self.preview(tokens, done)
            cost = time.perf_counter() - now
            self.next_preview = time.perf_counter() + max(self.MIN_PREVIEW_S, 5 * cost)
        preview = ("JPEG", image, min(preview_size(), max(image.size))) if image is not None else None
        self.bar.update_absolute(done, total, preview)
        progress_text(f"{self.label}: {done}/{total} tokens, {done / max(self.iterations, 1):.2f} per forward",
                      self.node_id)


def partial_image(vq: torch.nn.Module, tokens: torch.Tensor, done: int, grid: tuple[int, int]) -> Image.Image:
    """The first row of a token buffer decoded with the tokens fixed so far; the rest is grey."""
    h, w = grid
    codes = tokens[:1, : h * w].clone().clamp_(0, vq.cfg.codebook_size - 1)
    codes[:, done:] = 0
    with torch.no_grad():
        pixels = vq.decode(codes.view(1, h, w).to(vq.device)).float().clamp(-1, 1)[0]
    image = ((pixels + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    scale = image.shape[0] // h
    row, col = divmod(done, w)
    image[(row + 1) * scale:] = 128
    if row < h:
        image[row * scale:(row + 1) * scale, col * scale:] = 128
    return Image.fromarray(image)


def partial_latents_image(decoder: torch.nn.Module, latents: torch.Tensor) -> Image.Image:
    """One row of a MAR canvas (``latents`` [1, C, h, w], still-masked tokens at zero) through the KL
    autoencoder: the picture the fixed tokens draw so far."""
    with torch.no_grad():
        pixels = decoder.decode(latents.to(decoder.device)).float().clamp(-1, 1)[0]
    return Image.fromarray(((pixels + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy())
