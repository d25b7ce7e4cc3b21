"""Train the demo VQ tokenizer (LlamaGen VQ format, 128px -> 16x16 codes) on procedural images.

    python -m fastar.tools.train_vq [--steps N] [--out PATH]

Training sees random 64x64 crops: 4x cheaper than whole images (the nets are convolutional), so
4x more image content per second of this small CPU budget.
Losses: L1 + MSE reconstruction, codebook and commitment terms on L2-normalised vectors (the codebook
is normalised at lookup, so quantisation happens on the sphere), straight-through gradients. Codes
unused since the last check are re-seeded from batch latents to keep the codebook in use.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.nn.functional as F

from ..model_loaders.demo import DEMO_VQ
from ..model_loaders.vq import VQConfig, VQModel
from ..model_loaders import load_vq_model
from .demo_common import OUT_DIR, Timer, cosine_lr, psnr, save_fp16, setup, to_tensor, to_uint8
from .demo_data import balanced_labels, make_batch

CONFIG = VQConfig(codebook_size=512, embed_dim=8, z_channels=64, ch=32, ch_mult=(1, 1, 2, 2), num_res_blocks=1)


def quantise(model: VQModel, z: torch.Tensor):
    """Straight-through quantisation of latents [B, C, H, W] on the unit sphere; returns (zq, codes, vq loss)."""
    zn = F.normalize(z, dim=1)
    codes = model.quantize.nearest(zn)
    q = model.quantize.lookup(codes)
    loss = F.mse_loss(q, zn.detach()) + 0.25 * F.mse_loss(zn, q.detach())
    return zn + (q - zn).detach(), codes, loss


def crop_batch(pool: np.ndarray, rng: np.random.Generator, batch: int, size: int) -> torch.Tensor:
    idx = rng.integers(0, len(pool), batch)
    ys, xs = rng.integers(0, pool.shape[1] - size + 1, (2, batch))
    crops = np.stack([pool[i, y : y + size, x : x + size] for i, y, x in zip(idx, ys, xs)])
    flip = rng.random(batch) < 0.5
    crops[flip] = crops[flip, :, ::-1]
    return to_tensor(crops)


@torch.no_grad()
def evaluate(model: VQModel, images: torch.Tensor):
    """Reconstruction PSNR through the codes (exactly what the pack decodes) and codebook usage."""
    codes = torch.cat([model.encode(x) for x in images.split(16)])
    recon = torch.cat([model.decode_codes(c) for c in codes.split(16)])
    used = torch.unique(codes).numel() / model.cfg.codebook_size
    return psnr(recon, images), (recon.clamp(-1, 1) - images).pow(2).mean().item(), used, recon


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=700)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--crop", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--pool", type=int, default=2048, help="procedural images to crop from")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(DEMO_VQ))
    args = p.parse_args(argv)

    setup(args.seed)
    rng = np.random.default_rng(args.seed)
    timer = Timer()
    pool, _ = make_batch(rng, args.pool)
    held_out = to_tensor(make_batch(np.random.default_rng(10_000 + args.seed), 64, balanced_labels(64))[0])
    model = VQModel(CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    usage = torch.zeros(CONFIG.codebook_size)
    print(f"VQ {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, pool ready in {timer}")

    for step in range(args.steps):
        x = crop_batch(pool, rng, args.batch, args.crop)
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, args.steps, args.lr, warmup=100)
        # the codebook starts as random directions: latents of an untrained encoder are all alike,
        # so seeding codes from them would collapse the codebook
        z = model.encode_latent(x)
        zq, codes, vq_loss = quantise(model, z)
        recon = model.decode_vectors(zq)
        rec_loss = F.l1_loss(recon, x) + F.mse_loss(recon, x)
        loss = rec_loss + vq_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

        usage += torch.bincount(codes.flatten(), minlength=CONFIG.codebook_size)
        if (step + 1) % 50 == 0:
            dead = (usage == 0).nonzero().flatten()
            if len(dead):
                flat = F.normalize(z.detach(), dim=1).permute(0, 2, 3, 1).reshape(-1, CONFIG.embed_dim)
                pick = torch.randint(0, len(flat), (len(dead),))
                model.quantize.embedding.weight.data[dead] = flat[pick] + 0.01 * torch.randn(len(dead), CONFIG.embed_dim)
            print(f"step {step + 1}/{args.steps} loss {loss.item():.4f} rec {rec_loss.item():.4f} "
                  f"vq {vq_loss.item():.4f} used {int((usage > 0).sum())}/{CONFIG.codebook_size} "
                  f"reseeded {len(dead)} [{timer}]", flush=True)
            usage.zero_()

    model.eval()
    save_fp16(model, CONFIG, args.out)
    saved = load_vq_model(args.out)
    db, mse, used, recon = evaluate(saved, held_out)
    print(f"held-out (fp16 weights, through the codes): PSNR {db:.2f} dB, MSE {mse:.5f} ([-1,1] range), "
          f"codebook usage {used:.1%} on 64 images; total {timer}")
    OUT_DIR.mkdir(exist_ok=True)
    from PIL import Image

    pairs = np.concatenate([to_uint8(held_out[:16]), to_uint8(recon[:16])], axis=2)  # side by side
    grid = pairs.reshape(4, 4, 128, 256, 3).transpose(0, 2, 1, 3, 4).reshape(512, 1024, 3)
    Image.fromarray(grid).save(OUT_DIR / "vq_recon.png")


if __name__ == "__main__":
    main()
