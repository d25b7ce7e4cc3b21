"""What a generation needs in device memory, and what fits: the estimates ComfyUI is given before it loads the
models, the check that refuses a run which cannot fit (saying what would), and the size of the chunks images are
decoded in. Token models' needs grow with the batch (KV caches, activations, distributions); the weights do not.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .errors import FastARError
from .model_loaders.shared.transformer import SPARE_SLOTS
from .samplers.token_loops.acceptance import DISTANCE_CHUNK
from .samplers.token_loops.zipar import zipar_feeds

GB = 1e9
DECODE_CHUNK = 16  # images decoded at once at most (also on a CPU)
HEADROOM = 0.92  # of a GPU's memory a run may plan to use: the CUDA context, the allocator's fragmentation


def gb(n: float) -> str:
    return f"{n / GB:.1f} GB"


def element_bytes(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


def free_bytes(device: torch.device) -> int | None:
    """Memory a new allocation can take on ``device``: the driver's free memory plus PyTorch's cached blocks
    (None on a CPU: the host's memory is not planned here)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


# ------------------------------------------------------------------------------------------------ token models
def transformer_cfg(ar):
    """The sizes estimates read (``n_layer``, ``n_kv_head``, ``head_dim``, ``dim``, ``ffn_hidden``)."""
    return getattr(ar, "decoder_cfg", None) or ar.cfg


def cache_rows(batch: int, use_cfg: bool) -> int:
    return batch * (2 if use_cfg else 1)


def kv_bytes(layers: int, kv_heads: int, head_dim: int, rows: int, slots: int, dtype: torch.dtype) -> int:
    """A static KV cache's bytes, for ``slots`` a session uses (it holds SPARE_SLOTS more)."""
    return 2 * layers * rows * kv_heads * (slots + SPARE_SLOTS) * head_dim * element_bytes(dtype)


def kv_cache_bytes(ar, conditioning, batch: int, use_cfg: bool, window: int) -> int:
    """The static KV cache a decode of ``conditioning`` (one image's rows) allocates, known up front."""
    cfg = transformer_cfg(ar)
    return kv_bytes(cfg.n_layer, cfg.n_kv_head, cfg.head_dim, cache_rows(batch, use_cfg),
                    ar.cache_slots(conditioning, window), ar.dtype)


def decode_window(spec, drafted: bool, grid: tuple[int, int]) -> int:
    """The widest forward a token decode runs after its prefill (ZipAR: feeds in several rows at once)."""
    if spec.decoder in ("zipar", "zipar-sjd"):
        return zipar_feeds(grid, spec.zipar_lead, spec.window if spec.decoder == "zipar-sjd" else 1)
    return 1 if spec.decoder == "ar" else spec.gamma + 1 if drafted else spec.window


def token_working_bytes(ar, conditioning, batch: int, use_cfg: bool, spec, *, drafted: bool = False,
                        drafter_cache: int = 0) -> int:
    """Bytes a token decode (``spec``: a DecoderSpec) needs beyond the weights: the KV caches (the drafter's:
    ``drafter_cache``), the activations of the longest forward (the prefill or a window), the processed
    distributions (fp32), GSD's cluster distances (computed in bounded chunks) and LANTERN's neighbour table."""
    cfg = transformer_cfg(ar)
    window = min(decode_window(spec, drafted, ar.grid), ar.grid[0] * ar.grid[1])
    longest = ar.cache_slots(conditioning, window) - ar.grid[0] * ar.grid[1]  # at least the prefill or a window
    rows = cache_rows(batch, use_cfg)
    activations = rows * longest * (cfg.dim * 4 + cfg.ffn_hidden * 3) * element_bytes(ar.dtype) * 2
    distributions = 8 * batch * window * ar.vocab_size * 4  # p, q, residuals, noise
    clusters = neighbours = row_drafts = 0
    if spec.decoder == "gsd" and spec.group > 1:
        width = ar.code_embeddings().shape[-1]
        clusters = min(batch * window * (spec.group + 1) * width, DISTANCE_CHUNK) * 4 * 2  # the codes, their gaps
    if spec.decoder == "lantern":
        neighbours = ar.vocab_size * spec.lantern_k * 8
    if spec.decoder == "zipar-sjd":  # every image row's carried drafts and their distributions
        row_drafts = batch * ar.grid[0] * (spec.window - 1) * ar.vocab_size * 4
    return int(kv_cache_bytes(ar, conditioning, batch, use_cfg, window) + drafter_cache + activations + distributions
               + clusters + neighbours + row_drafts)


# ------------------------------------------------------------------------------------------------ the check
@dataclass
class Need:
    """A run's memory: ``weights`` (whatever the batch) and ``working(batch)``, for the batch asked. Of the
    weights, ``streamable`` bytes may stay in host memory and stream to the device at each step
    (model_loaders/shared/streaming.py), which then needs ``stream_buffer`` bytes for the layers in flight."""

    weights: dict  # name -> bytes
    working: Callable[[int], int]  # batch -> bytes
    batch: int
    streamable: int = 0
    stream_buffer: int = 0

    def total(self, batch: int | None = None) -> int:
        """Everything on the device."""
        return sum(self.weights.values()) + self.working(self.batch if batch is None else batch)

    def least(self, batch: int | None = None) -> int:
        """What must be on the device when every weight that can stream does."""
        return self.total(batch) - self.streamable + (self.stream_buffer if self.streamable else 0)

    def largest_batch(self, available: float) -> int:
        """The largest batch (0: none) whose least need fits ``available`` bytes, up to the batch asked."""
        fitting = 0
        for batch in range(1, self.batch + 1):
            if self.least(batch) > available:
                break
            fitting = batch
        return fitting


def check_room(need: Need, capacity: int, device: str, *, dtype: torch.dtype) -> bool:
    """Refuse, before anything is loaded or decoded, a run that cannot fit ``capacity`` bytes (the GPU's memory
    when other models can be offloaded, else its free memory), saying what it needs and what would fit. Returns
    whether it fits only with some weights streamed from host memory."""
    usable = capacity * HEADROOM
    if need.total() <= usable:
        return False
    if need.least() <= usable:
        return True
    parts = "".join(f"{name} {gb(n)}, " for name, n in need.weights.items())
    streamed = (f"; {gb(need.least())} with the blocks' weights streamed from system memory"
                if need.streamable else "")
    what = (f"this run needs about {gb(need.total())} of memory on {device} ({parts}KV caches and activations "
            f"{gb(need.working(need.batch))} for {need.batch} image(s) at once{streamed}), and {gb(capacity)} is there")
    fitting = need.largest_batch(usable)
    if fitting:
        advice = (f"{fitting} image(s) at once fit ({gb(need.least(fitting))}): lower the batch, or generate in "
                  "several runs")
    else:
        smaller = " load the model in bf16 or fp16 (half the weights)," if dtype == torch.float32 else ""
        advice = (f"not even batch 1 fits ({gb(need.least(1))}):{smaller} pick a smaller image size where the "
                  "model has one, or run on the CPU (slow)")
    raise FastARError(f"{what}: {advice}")


# ------------------------------------------------------------------------------------------------ image decoding
def decode_bytes_per_image(decoder, grid: tuple[int, int]) -> int:
    """Peak bytes of decoding one image of ``grid`` tokens (or latents): its pixels times the decoder's top-level
    channels, a few tensors deep (a resblock's input, its convolutions' and norms' outputs)."""
    pixels = grid[0] * grid[1] * decoder.cfg.downsample ** 2
    return pixels * decoder.cfg.ch * element_bytes(next(decoder.parameters()).dtype) * 8


def images_per_chunk(decoder, inputs: torch.Tensor) -> int:
    """How many images to decode at once: up to DECODE_CHUNK, as many as the decoder's device has room for."""
    free = free_bytes(decoder.device)
    if free is None:
        return DECODE_CHUNK
    per_image = decode_bytes_per_image(decoder, tuple(inputs.shape[-2:]))
    return max(1, min(DECODE_CHUNK, int(free * HEADROOM) // per_image))
