"""Tiny Infinity transformers and BSQ VAEs for the tests: FastAR's classes with random weights, and the state dicts
as the release saves them (blocks in ``block_chunks``, the zero key biases as buffers)."""
from __future__ import annotations

import torch

from fastar.model_loaders.infinity.model import Infinity, InfinityConfig
from fastar.model_loaders.infinity.schedules import scale_schedule
from fastar.model_loaders.infinity.vae import InfinityVAE, InfinityVAEConfig
from fastar.model_loaders.shared.protocol import CaptionConditioning

TEXT = 16  # the tiny T5's width
CHUNKS = 2


def tiny_config(bits: int = 8, patchify: bool = False, image_size: int = 256, aspect_ratio=None,
                depth: int = 2) -> InfinityConfig:
    scales, rope_grid = scale_schedule(image_size, aspect_ratio)
    return InfinityConfig(depth=depth, dim=32, n_head=2, ffn_hidden=64, text_channels=TEXT, pool_heads=2, bits=bits,
                          patchify=patchify, text_tokens=12, scales=scales, rope_grid=rope_grid)


def tiny_infinity(seed: int = 0, **kw) -> Infinity:
    """Random weights of about unit gain, so that every part moves the bit logits."""
    model = Infinity(tiny_config(**kw))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("scale_mul_1H11"):
                p.copy_(torch.log(torch.full_like(p, 4.0)) + torch.randn(p.shape, generator=g) * 0.5)
            elif p.dim() == 2 and "embed" not in name and name != "cfg_uncond":
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5 * (0.5 if "ada" in name else 1.0))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.1 if name.endswith("bias") else 1.0))
    return model.eval().requires_grad_(False)


def tiny_vae(bits: int = 8, patchify: bool = False) -> InfinityVAE:
    """The BSQ VAE for a tiny model: d bits a cell, 16 px a token (8 px cells where tokens fold 2 x 2); next_input
    needs no weights."""
    levels = 4 if patchify else 5
    vae = InfinityVAE(InfinityVAEConfig(codebook_dim=bits // 4 if patchify else bits, ch=32, ch_mult=(1,) * levels,
                                        num_res_blocks=0))
    return vae.eval().requires_grad_(False)


def release_state_dict(model: Infinity, chunks: int = CHUNKS) -> dict:
    """``model``'s weights under the release's names: ``block_chunks.{c}.module.{j}``, zero key buffers added."""
    per_chunk = model.cfg.depth // chunks
    sd = {}
    for key, value in model.state_dict().items():
        if key.startswith("blocks."):
            index, rest = key[len("blocks."):].split(".", 1)
            key = f"block_chunks.{int(index) // per_chunk}.module.{int(index) % per_chunk}.{rest}"
        sd[key] = value.clone()
    zero = torch.zeros(model.cfg.dim)
    sd["text_proj_for_sos.ca.zero_k_bias"] = zero.clone()
    for c in range(chunks):
        for j in range(per_chunk):
            sd[f"block_chunks.{c}.module.{j}.sa.zero_k_bias"] = zero.clone()
            sd[f"block_chunks.{c}.module.{j}.ca.zero_k_bias"] = zero.clone()
    return sd


def captions(lengths=(5, 3), seed: int = 3) -> CaptionConditioning:
    """Random caption features, real tokens first, rows of the given lengths (padding zeroed)."""
    T = max(lengths)
    mask = torch.arange(T)[None] < torch.tensor(lengths)[:, None]
    features = torch.randn(len(lengths), T, TEXT, generator=torch.Generator().manual_seed(seed))
    return CaptionConditioning(features * mask[..., None], mask)
