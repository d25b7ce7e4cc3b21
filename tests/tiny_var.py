"""Tiny random VAR models and multi-scale VQVAEs, and the release's file layouts (``var_d*.pth``: the raw state
dict, buffers included; ``vae_ch160v4096z32.pth``: fused attention and the codebook-usage buffer), for the
loader, CLI and ComfyUI tests. Random weights: the plumbing is real, the images are not."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from fastar.model_loaders.var.dd_student import VARDDConfig, VARDDStudent
from fastar.model_loaders.var.model import VAR, VARConfig
from fastar.model_loaders.var.vqvae import MultiScaleVQVAE, VQVAEConfig, fuse_attention

PATCH_NUMS = (1, 2, 3, 4)


def randomised(module: torch.nn.Module, seed: int, scale: float = 0.3) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in module.parameters():
            tensor.copy_(torch.randn(tensor.shape, generator=g) * scale)
    return module.eval()


def tiny_var(seed=0, patch_nums=PATCH_NUMS, classes=5) -> VAR:
    cfg = VARConfig(depth=2, dim=32, n_head=2, vocab_size=16, channels=4, num_classes=classes, patch_nums=patch_nums)
    return randomised(VAR(cfg), seed)


def tiny_vqvae(seed=1) -> MultiScaleVQVAE:
    cfg = VQVAEConfig(codebook_size=16, embed_dim=4, z_channels=4, ch=32, ch_mult=(1, 2, 2), num_res_blocks=1,
                      encoder_attn_levels=(2,), decoder_attn_levels=(2,), patch_nums=PATCH_NUMS)
    return randomised(MultiScaleVQVAE(cfg), seed, 0.1)


def release_var_state_dict(model: VAR) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def release_vqvae_state_dict(vqvae: MultiScaleVQVAE, scales: int) -> dict:
    sd = fuse_attention(vqvae.state_dict())
    sd["quantize.ema_vocab_hit_SV"] = torch.zeros(scales, vqvae.cfg.codebook_size)
    return sd


def write_release_files(folder: Path, model_name: str = "var_tiny.pth", vqvae_name: str = "vae_var_tiny.pth",
                        classes: int = 5) -> None:
    """A tiny VAR (with a NAME.json giving its patch_nums, which no release size explains) and its VQVAE."""
    folder = Path(folder)
    torch.save(release_var_state_dict(tiny_var(classes=classes)), folder / model_name)
    (folder / model_name).with_suffix(".json").write_text(json.dumps({"patch_nums": list(PATCH_NUMS)}))
    torch.save(release_vqvae_state_dict(tiny_vqvae(), len(PATCH_NUMS)), folder / vqvae_name)
    (folder / vqvae_name).with_suffix(".json").write_text(json.dumps({"patch_nums": list(PATCH_NUMS)}))


def tiny_var_dd(seed=5, classes=5) -> VARDDStudent:
    cfg = VARDDConfig(depth=2, dim=32, n_head=2, vocab_size=16, channels=4, num_classes=classes, patch_nums=PATCH_NUMS,
                      t2=5, split=5)
    return randomised(VARDDStudent(cfg), seed)


def write_release_student(folder: Path, name: str = "var-dd-tiny.pth", classes: int = 5) -> None:
    """A tiny VAR-DD student as the release stores one (weights under ``["trainer"]["ema_parameters"]``), with a
    NAME.json for its scales and split (two scales: 5 tokens); it decodes with ``write_release_files``' VQVAE."""
    folder = Path(folder)
    torch.save({"trainer": {"ema_parameters": tiny_var_dd(classes=classes).state_dict()}}, folder / name)
    (folder / name).with_suffix(".json").write_text(json.dumps({"patch_nums": list(PATCH_NUMS), "split_t": 2}))
