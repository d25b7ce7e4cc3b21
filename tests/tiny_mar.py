"""Tiny random MAR models and KL autoencoders in the official file formats, for the loader, CLI and ComfyUI
tests: a MAR checkpoint as LTH14/mar saves it ({"model", "model_ema", "args"}) and an LDM KL autoencoder
({"model": sd} with the training loss's keys). Random weights: the plumbing is real, the images are not."""
from __future__ import annotations

import argparse

import torch

from fastar.model_loaders.mar.kl_vae import KLAutoencoder
from fastar.model_loaders.shared.ldm_blocks import KLConfig
from fastar.model_loaders.mar.model import MAR, MARConfig

KL = KLConfig(embed_dim=4, ch=32, ch_mult=(1, 2), num_res_blocks=1, encoder_attn_levels=(), decoder_attn_levels=())


def mar_config(**kw) -> MARConfig:
    base = dict(dim=32, encoder_depth=1, encoder_heads=2, decoder_dim=32, decoder_depth=1, decoder_heads=2,
                head_width=32, head_depth=2, token_dim=4, grid=(4, 4), buffer=2, num_classes=3)
    return MARConfig(**{**base, **kw})


def random_model(model_class, cfg, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = model_class(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model


def official_mar(path, cfg: MARConfig, seed: int, **args):
    """A MAR .pth as the official training saves it (EMA weights beside the raw ones, the training args)."""
    sd = random_model(MAR, cfg, seed).state_dict()
    saved = {"model": sd, "model_ema": {k: v.clone() for k, v in sd.items()},
             "args": argparse.Namespace(model="mar_tiny", vae_embed_dim=cfg.token_dim, patch_size=1, **args)}
    torch.save(saved, path)
    return path


def official_kl(path, cfg: KLConfig = KL, seed: int = 0):
    """An LDM AutoencoderKL checkpoint ({"model": sd}), with a discriminator key as training files have."""
    kl = random_model(KLAutoencoder, cfg, seed).state_dict()
    out = kl["decoder.conv_out.weight"]  # after the decoder's group norms, 0.02 weights would give flat grey images
    kl["decoder.conv_out.weight"] = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)) * 0.3
    kl["loss.discriminator.weight"] = torch.zeros(3)
    torch.save({"model": kl}, path)
    return path

