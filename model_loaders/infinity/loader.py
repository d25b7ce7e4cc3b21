"""Loading Infinity transformers: ``infinity_2b_reg.pth`` (a raw state dict; a training checkpoint's
``["trainer"]["gpt_fsdp"]``, what the release's ``save_slim_model`` keeps, is read too) and the 8B's folder of shards
with their index (``infinity_8b_weights/``, read shard by shard).

Sizes come from the weights: width and bits per token from ``word_embed``, text width from ``text_norm``, depth
from the blocks, heads from ``scale_mul_1H11`` (head_dim 128 in both releases), the pool's heads from its
``mat_q``, FFN width from ``fc1``; the 8B's 2 x 2 patches from its bits (56 = 4 x 14). The release's blocks sit in
chunks (``block_chunks.{c}.module.{j}``, 8 chunks in both sizes); they are renumbered in order. The scales follow
from ``image_size`` and ``aspect_ratio`` (schedules.py).
"""
from __future__ import annotations

import re
from dataclasses import replace

import torch

from ...errors import FastARError
from ..shared.building import build_and_load, checkpoint_of
from ..shared.checkpoint import CheckpointInfo, select, shape_of
from .model import Infinity, InfinityConfig
from .schedules import scale_schedule

CHUNKED = re.compile(r"^block_chunks\.(\d+)\.module\.(\d+)\.")
# buffers the release's load_state_dict drops from a file (its attention masks; FastAR makes none) and its zero key
# biases (zeros the model adds without storing)
DROPPED = re.compile(r"(^|\.)zero_k_bias$"
                     r"|^(lvl_1L|attn_bias_for_masking|Infinity_visible_kvlen|Infinity_invisible_qlen)$")
PATCHIFIED_BITS = (56,)  # the 8B's VAE codes 14 bits per 8 px patch, and its tokens fold 2 x 2 patches


def load_infinity(path_or_state_dict, *, device="cpu", dtype=torch.float32, info: CheckpointInfo | None = None,
                  image_size: int | None = None, aspect_ratio: str | None = None) -> Infinity:
    """An Infinity transformer in eval mode without gradients, drawing ``image_size`` px (256, 512, 768, 1024) images
    of ``aspect_ratio`` ("W:H")."""
    sd, info = checkpoint_of(path_or_state_dict, info)
    sd = renumbered(sd)
    scales, rope_grid = scale_schedule(image_size, aspect_ratio)
    cfg = replace(infinity_config(sd, info.source, info.settings()), scales=scales, rope_grid=rope_grid)
    return build_and_load(Infinity, cfg, sd, info.source, device, dtype)


def renumbered(sd):
    """``block_chunks.{c}.module.{j}.*`` as ``blocks.{i}.*``, i counting through the chunks in order; ``DROPPED``
    left out."""
    chunks = [CHUNKED.match(k) for k in sd]
    per_chunk = 1 + max((int(m.group(2)) for m in chunks if m), default=-1)
    names = {}
    for key, found in zip(sd, chunks):
        if DROPPED.search(key):
            continue
        if found:
            index = int(found.group(1)) * per_chunk + int(found.group(2))
            names[f"blocks.{index}.{key[found.end():]}"] = key
        else:
            names[key] = key
    return select(sd, names)


def shape(sd, key: str, source: str) -> tuple[int, ...]:
    if key not in sd:
        raise FastARError(f"{source} has no {key} weight: the file is incomplete, re-download it")
    return shape_of(sd, key)


def infinity_config(sd, source: str, settings: dict) -> InfinityConfig:
    dim, bits = shape(sd, "word_embed.weight", source)
    depth = 1 + max((int(k.split(".")[1]) for k in sd if k.startswith("blocks.")), default=-1)
    if depth == 0:
        raise FastARError(f"{source} has no transformer blocks: the file is incomplete, re-download it")
    patchify = bool(settings.get("apply_spatial_patchify", bits in PATCHIFIED_BITS))
    if patchify and bits % 4:
        raise FastARError(f"{source}: {bits} bits per token cannot be 2 x 2 patches of a VAE's codes")
    return InfinityConfig(
        depth=depth, dim=dim, n_head=shape(sd, "blocks.0.sa.scale_mul_1H11", source)[1],
        ffn_hidden=shape(sd, "blocks.0.ffn.fc1.weight", source)[0],
        text_channels=shape(sd, "text_norm.weight", source)[0],
        pool_heads=shape(sd, "text_proj_for_sos.ca.mat_q", source)[1], bits=bits, patchify=patchify,
        text_tokens=shape(sd, "cfg_uncond", source)[0], levels=shape(sd, "lvl_embed.weight", source)[0])
