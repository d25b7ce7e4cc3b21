"""Train the demo KL autoencoder (LDM AutoencoderKL format, 128px -> 8x8 latents of 16 channels, like KL-16).

    python -m fastar.demo_recipes.train_kl_vae [--steps N] [--out PATH]

MAR's image decoder. The LDM layout at width 64 (the final GroupNorm then normalises pairs of channels;
at 32 it would erase absolute colour, see train_vq), no attention outside the middle block, one residual
block per level. Training sees random 64x64 crops (the nets are convolutional): reconstruction (L1 + MSE)
of a posterior sample plus a small KL term, which keeps the latent space smooth and its scale bounded for
the MAR model that learns it. Prints the latents' standard deviation: MAR's scale factor is its inverse.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..model_loaders import load_image_decoder
from ..model_loaders.shared.demo import DEMO_KL
from ..model_loaders.mar.kl_vae import KLAutoencoder
from ..model_loaders.shared.ldm_blocks import KLConfig
from .demo_common import OUT_DIR, psnr, save_autoencoder, to_uint8
from ..commands.training import cosine_lr, setup, Timer, train_step
from . import autoencoder_data

CONFIG = KLConfig(embed_dim=16, ch=64, ch_mult=(1, 1, 2, 2, 2), num_res_blocks=1, encoder_attn_levels=(),
                  decoder_attn_levels=())


def kl_divergence(mean: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    """KL(N(mean, exp(logvar)) || N(0, 1)), averaged over elements."""
    return 0.5 * (mean.pow(2) + logvar.exp() - 1.0 - logvar).mean()


@torch.no_grad()
def evaluate(model: KLAutoencoder, images: torch.Tensor) -> dict:
    """Reconstruction from the posterior mean (what MAR's training data is drawn around)."""
    means = torch.cat([model.encode_moments(x)[0] for x in images.split(16)])
    recon = torch.cat([model.decode_latents(m) for m in means.split(16)]).clamp(-1, 1)
    per_image = [psnr(r[None], x[None]) for r, x in zip(recon, images)]
    return {"psnr": float(np.mean(per_image)), "latent_std": float(means.std()), "recon": recon}


def main(argv=None):
    p = autoencoder_data.parser(__doc__, steps=1200, lr=4e-4, out=str(DEMO_KL))
    p.add_argument("--kl-weight", type=float, default=2e-4)
    args = p.parse_args(argv)

    setup(args.seed)
    timer = Timer()
    rng, pool, held_out = autoencoder_data.images(args.seed, args.pool, args.texture, args.held_out)
    model = KLAutoencoder(CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    print(f"KL VAE {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, pool ready in {timer}")

    for step in range(args.steps):
        x = autoencoder_data.crop_batch(pool, rng, args.batch, args.crop)
        mean, logvar = model.encode_moments(x)
        z = mean + torch.exp(0.5 * logvar) * torch.randn_like(mean)
        recon = model.decode_latents(z)
        rec_loss = F.l1_loss(recon, x) + F.mse_loss(recon, x)
        kl = kl_divergence(mean, logvar)
        loss = rec_loss + args.kl_weight * kl
        train_step(opt, loss, cosine_lr(step, args.steps, args.lr, warmup=100), clip=1.0)
        if (step + 1) % 50 == 0:
            print(f"step {step + 1}/{args.steps} loss {loss.item():.4f} rec {rec_loss.item():.4f} kl {kl.item():.3f} "
                  f"posterior std {torch.exp(0.5 * logvar).mean().item():.3f} [{timer}]", flush=True)

    model.eval()
    saved = load_image_decoder(save_autoencoder(model, CONFIG, args.out))
    result = evaluate(saved, held_out)
    print(f"held-out (fp16 weights, posterior mean, {len(held_out)} images): PSNR {result['psnr']:.2f} dB per image, "
          f"latent std {result['latent_std']:.4f} (MAR scale factor {1 / result['latent_std']:.4f}); total {timer}")
    OUT_DIR.mkdir(exist_ok=True)
    from PIL import Image

    pairs = np.concatenate([to_uint8(held_out[:16]), to_uint8(result["recon"][:16])], axis=2)
    grid = pairs.reshape(4, 4, 128, 256, 3).transpose(0, 2, 1, 3, 4).reshape(512, 1024, 3)
    Image.fromarray(grid).save(OUT_DIR / "kl_recon.png")


if __name__ == "__main__":
    main()
