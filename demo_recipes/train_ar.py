"""Train the demo class-to-image AR model (LlamaGen c2i format) on VQ tokens of procedural images.

    python -m fastar.demo_recipes.train_ar [--steps N] [--out PATH]

Images are drawn from ``demo_data``, tokenised once with the demo VQ (cached under ``.data/``, keyed by
the VQ file's hash), then a small LlamaGen GPT learns them with teacher forcing. Labels drop to the
null class with probability 0.1 so that classifier-free guidance works at sampling time.

``--flat-steps N``: a curriculum. On textured images most of the loss is the texture's (many codes encode a
textured patch about equally well), and a small model learns the shapes slowly under it; over the first N steps a
shrinking share of each batch (all of it, falling to none) is flat images through the same VQ, whose shapes it
learns fast, then texture alone. ``--resume`` continues a run cut short (its state is saved every 100 steps).
"""
from __future__ import annotations

import argparse
import copy
from dataclasses import asdict
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

from ..model_loaders.shared.demo import DEMO_AR, DEMO_VQ
from ..model_loaders.llamagen.model import LlamaGenConfig, LlamaGenGPT
from ..model_loaders.shared.protocol import ClassConditioning
from ..model_loaders import load_ar_model, load_image_decoder
from .demo_common import checkpoint_path, tokenised
from ..commands.training import (Checkpoints, Timer, adamw, cosine_lr, ema_update, init_weights, save_fp16, setup,
                                 train_step)
from ..commands.bench.demo_data import CLASS_NAMES, TEXTURE_LEVELS, make_batch


def model_config(vocab_size: int) -> LlamaGenConfig:
    return LlamaGenConfig(
        dim=256, n_layer=4, n_head=8, vocab_size=vocab_size, grid=(16, 16), downsample=8,
        num_classes=len(CLASS_NAMES), class_names=list(CLASS_NAMES),
    )


@torch.no_grad()
def init_from_codebook(model: LlamaGenGPT, vq_path, gen: torch.Generator) -> None:
    """Token embeddings and output head start as random projections of the VQ's code vectors (each with its own
    projection), scaled to LlamaGen's init std: codes that look alike start alike, so the model reads and predicts
    the colour of a textured patch from the start instead of learning it code by code."""
    codes = load_image_decoder(vq_path).quantize.codebook().float()  # unit vectors
    for weight in (model.tok_embeddings.weight, model.output.weight):
        projection = torch.randn(codes.shape[1], weight.shape[1], generator=gen)
        weight.copy_(0.02 * codes @ projection)


@torch.no_grad()
def val_loss(model: LlamaGenGPT, tokens, labels) -> float:
    model.eval()
    losses = [
        F.cross_entropy(model.training_logits(ClassConditioning(y), t).flatten(0, 1), t.flatten()).item()
        for t, y in zip(tokens.long().split(64), labels.split(64))
    ]
    model.train()
    return float(np.mean(losses))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--images", type=int, default=8000, help="training images (tokenised once)")
    p.add_argument("--val-images", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--texture", type=float, default=TEXTURE_LEVELS,
                   help="the images' texture, its largest excursion in 8-bit levels (0: flat colours)")
    p.add_argument("--flat-steps", type=int, default=1000,
                   help="curriculum: over the first N steps a falling share of flat images (0: none)")
    p.add_argument("--ema", type=float, default=0.998, help="save the weights' EMA with this decay (0: the weights)")
    p.add_argument("--codebook-init", action=argparse.BooleanOptionalAction, default=True,
                   help="start the token embeddings and output head from the VQ's code vectors")
    p.add_argument("--resume", action="store_true",
                   help="continue the run that was cut short (saved every 100 steps under .data/checkpoints/)")
    p.add_argument("--vq", default=str(DEMO_VQ))
    p.add_argument("--out", default=str(DEMO_AR))
    args = p.parse_args(argv)

    gen = setup(args.seed)
    timer = Timer()
    draw = partial(make_batch, texture=args.texture / 255)
    tokens, labels = tokenised(f"ar_t{args.texture:g}", args.vq, args.images, args.seed, draw)
    val_tokens, val_labels = tokenised(f"ar_t{args.texture:g}", args.vq, args.val_images, 10_000 + args.seed, draw)
    if args.flat_steps:
        flat_tokens, flat_labels = tokenised("ar_t0", args.vq, args.images, args.seed, make_batch)
    print(f"{len(tokens)} training images tokenised [{timer}]")

    cfg = model_config(int(load_image_decoder(args.vq).cfg.codebook_size))
    model = LlamaGenGPT(cfg)
    init_weights(model)
    if args.codebook_init:
        init_from_codebook(model, args.vq, gen)
    print(f"AR {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params: {asdict(cfg)}")
    opt = adamw(model, args.lr, weight_decay=0.05)
    null = cfg.num_classes
    ema = copy.deepcopy(model).requires_grad_(False) if args.ema else None
    modules = {"model": model} | ({"ema": ema} if ema else {})
    checkpoints = Checkpoints(checkpoint_path(args.out), 100, modules, opt, gen)
    for step in range(checkpoints.resume() if args.resume else 0, args.steps):
        idx = torch.randint(0, len(tokens), (args.batch,), generator=gen)
        x, y = tokens[idx].long(), labels[idx].clone()
        if step < args.flat_steps:
            flat = torch.rand(args.batch, generator=gen) < 1 - step / args.flat_steps
            x[flat], y[flat] = flat_tokens[idx[flat]].long(), flat_labels[idx[flat]]
        y[torch.rand(args.batch, generator=gen) < 0.1] = null  # CFG needs the null class
        logits = model.training_logits(ClassConditioning(y), x)
        loss = F.cross_entropy(logits.flatten(0, 1), x.flatten())
        train_step(opt, loss, cosine_lr(step, args.steps, args.lr, warmup=min(100, args.steps // 10)), clip=1.0)
        if ema:
            ema_update(ema, model, min(args.ema, (1 + step) / (10 + step)))
        if (step + 1) % 25 == 0:
            print(f"step {step + 1}/{args.steps} train loss {loss.item():.4f} [{timer}]", flush=True)
        if (step + 1) % (args.steps // 2) == 0 and step + 1 < args.steps:
            print(f"  val loss {val_loss(model, val_tokens, val_labels):.4f}", flush=True)
        checkpoints.after(step)

    if ema:
        print(f"val loss of the trained weights {val_loss(model, val_tokens, val_labels):.4f}; saving their EMA")
    save_fp16((ema or model).eval(), cfg, args.out)
    saved = load_ar_model(args.out)
    print(f"final val loss (fp16 weights, {len(val_tokens)} held-out images): "
          f"{val_loss(saved, val_tokens, val_labels):.4f}; total {timer}")
    checkpoints.finish()


if __name__ == "__main__":
    main()
