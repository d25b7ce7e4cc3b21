"""Train the demo VQ tokenizer (LlamaGen VQ format, 128px -> 16x16 codes) on procedural images.

    python -m fastar.demo_recipes.train_vq [--steps N] [--out PATH]

Architecture: the LlamaGen VQ decoder at width 64, so its final GroupNorm(32) normalises pairs of channels
(at width 32 it is an instance norm per channel, which erases absolute colour), and a patch encoder:
each 8x8 patch is encoded on its own, so equal patches get equal codes (a global encoder gave a flat
black patch one of ~100 codes, depending on the rest of the image, and the AR model had to guess which).
Training sees random 64x64 crops: 4x cheaper than whole images (the nets are convolutional), so
4x more image content per second of this small CPU budget; small batches at a low learning rate learned
fastest per CPU second.
Losses: L1 + MSE reconstruction, codebook and commitment terms on L2-normalised vectors (the codebook
is normalised at lookup, so quantisation happens on the sphere), straight-through gradients. Codes
unused since the last check are re-seeded from batch latents to keep the codebook in use, until 85% of
the steps (then the codebook settles).
The images carry demo_data's texture (``--texture``, default ``TEXTURE_LEVELS``) and the codebook has 4096 codes:
like a real VQ-16 tokenizer, it spends many codes on textured patches of one colour, which many codes encode
about equally well; that is what makes the GPT's next token ambiguous, as a real model's is.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F

from ..model_loaders.shared.demo import DEMO_VQ
from ..model_loaders.llamagen.vq import VQConfig, VQModel
from ..model_loaders import load_image_decoder
from .demo_common import OUT_DIR, psnr, save_autoencoder, to_uint8
from ..commands.training import cosine_lr, setup, Timer, train_step
from ..commands.bench.demo_data import TEXTURE_LEVELS
from . import autoencoder_data

CONFIG = VQConfig(codebook_size=4096, embed_dim=8, z_channels=64, ch=64, ch_mult=(1, 1, 2, 2), num_res_blocks=1,
                  patch_encoder=True)


def quantise(model: VQModel, z: torch.Tensor):
    """Straight-through quantisation of latents [B, C, H, W] on the unit sphere; returns (zq, codes, vq loss)."""
    zn = F.normalize(z, dim=1)
    codes = model.quantize.nearest(zn)
    q = model.quantize.lookup(codes)
    loss = F.mse_loss(q, zn.detach()) + 0.25 * F.mse_loss(zn, q.detach())
    return zn + (q - zn).detach(), codes, loss


@torch.no_grad()
def evaluate(model: VQModel, images: torch.Tensor) -> dict:
    """Reconstruction through the codes (exactly what the pack decodes): PSNR per image averaged, PSNR of
    the pooled error, codebook usage, and how many codes flat patches of one colour get (1 = canonical)."""
    codes = torch.cat([model.encode(x) for x in images.split(16)])
    recon = torch.cat([model.decode_codes(c) for c in codes.split(16)]).clamp(-1, 1)
    per_image = [psnr(r[None], x[None]) for r, x in zip(recon, images)]
    return {"psnr": float(np.mean(per_image)), "pooled_psnr": psnr(recon, images),
            "usage": torch.unique(codes).numel() / model.cfg.codebook_size,
            "flat_codes": codes_per_flat_colour(images, codes, model.cfg.downsample), "recon": recon}


def codes_per_flat_colour(images: torch.Tensor, codes: torch.Tensor, patch: int) -> float:
    """Mean number of distinct codes given to flat patches of the same colour."""
    patches = images.unfold(2, patch, patch).unfold(3, patch, patch).flatten(-2)  # [B, 3, h, w, p*p]
    flat = patches.std(-1).amax(1) < 1e-3
    colour = (patches[..., 0] * 127.5).round().long().permute(0, 2, 3, 1)[flat]  # [n, 3]
    found = {}
    for rgb, code in zip(map(tuple, colour.tolist()), codes[flat].tolist()):
        found.setdefault(rgb, set()).add(code)
    return float(np.mean([len(c) for c in found.values()])) if found else 0.0


def main(argv=None):
    p = autoencoder_data.parser(__doc__, steps=3600, lr=3e-4, out=str(DEMO_VQ), texture=TEXTURE_LEVELS)
    p.add_argument("--codebook", type=int, default=CONFIG.codebook_size, help="codes in the codebook")
    args = p.parse_args(argv)
    config = replace(CONFIG, codebook_size=args.codebook)

    setup(args.seed)
    timer = Timer()
    rng, pool, held_out = autoencoder_data.images(args.seed, args.pool, args.texture, args.held_out)
    model = VQModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    usage = torch.zeros(config.codebook_size)
    print(f"VQ {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, pool ready in {timer}")
    # codes unused over this many steps are re-seeded: about 50 tokens per code, whatever the codebook's size
    reseed_every = max(50, 50 * config.codebook_size // 512)

    for step in range(args.steps):
        x = autoencoder_data.crop_batch(pool, rng, args.batch, args.crop)
        # the codebook starts as random directions: latents of an untrained encoder are all alike,
        # so seeding codes from them would collapse the codebook
        z = model.encode_latent(x)
        zq, codes, vq_loss = quantise(model, z)
        recon = model.decode_vectors(zq)
        rec_loss = F.l1_loss(recon, x) + F.mse_loss(recon, x)
        loss = rec_loss + vq_loss
        train_step(opt, loss, cosine_lr(step, args.steps, args.lr, warmup=100), clip=1.0)

        usage += torch.bincount(codes.flatten(), minlength=config.codebook_size)
        if (step + 1) % reseed_every == 0:
            dead = (usage == 0).nonzero().flatten()
            if len(dead) and step < 0.85 * args.steps:  # then the codebook settles
                flat = F.normalize(z.detach(), dim=1).permute(0, 2, 3, 1).reshape(-1, config.embed_dim)
                pick = torch.randint(0, len(flat), (len(dead),))
                model.quantize.embedding.weight.data[dead] = flat[pick] + 0.01 * torch.randn(len(dead), config.embed_dim)
            print(f"step {step + 1}/{args.steps} loss {loss.item():.4f} rec {rec_loss.item():.4f} "
                  f"vq {vq_loss.item():.4f} used {int((usage > 0).sum())}/{config.codebook_size} "
                  f"unused {len(dead)} [{timer}]", flush=True)
            usage.zero_()

    model.eval()
    saved = load_image_decoder(save_autoencoder(model, config, args.out))
    result = evaluate(saved, held_out)
    recon = result["recon"]
    print(f"held-out (fp16 weights, through the codes, {len(held_out)} images): PSNR {result['psnr']:.2f} dB per image "
          f"(pooled {result['pooled_psnr']:.2f} dB), codebook usage {result['usage']:.1%}, "
          f"{result['flat_codes']:.2f} codes per flat colour; total {timer}")
    OUT_DIR.mkdir(exist_ok=True)
    from PIL import Image

    pairs = np.concatenate([to_uint8(held_out[:16]), to_uint8(recon[:16])], axis=2)  # side by side
    grid = pairs.reshape(4, 4, 128, 256, 3).transpose(0, 2, 1, 3, 4).reshape(512, 1024, 3)
    Image.fromarray(grid).save(OUT_DIR / "vq_recon.png")


if __name__ == "__main__":
    main()
