"""Train the demo VAR's multi-scale VQVAE (VAR's VQVAE format, 128px -> 8x8 f_hat of 16 channels, scales
1, 2, 3, 4, 6, 8).

    python -m fastar.demo_recipes.train_var_vqvae [--quantiser-steps N] [--decoder-steps N] [--out PATH]

It starts from the demo KL autoencoder (the same LDM encoder and decoder: the encoder's mean half becomes the
latent, the 1x1 convs the centre taps of the VQVAE's 3x3 ones), and trains in two stages that a CPU can afford,
instead of the release's end-to-end recipe:

1. the quantiser, in latent space: the encoder is frozen, so the full-size latents of the training images are
   computed once; the codebook (seeded from latents of every scale's residual) and the Phi convs learn to make
   f_hat close to the latent (the release's codebook term; codes nobody picks are re-seeded from latents);
2. the decoder (and post_quant_conv), on full 128 px images decoded from f_hat: the codebook is frozen, so the
   decoder learns to draw what the quantised latents say.

Full-size images, never crops: the scales are fractions of the latent, so a crop quantises differently from the
image it came from (64 px crops gave 4x4 latents, upsampled to the 8x8 scale, and training on them made the
128 px reconstructions worse).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..model_loaders import load_image_decoder
from ..model_loaders.shared.demo import DEMO_KL, DEMO_VAR_VQVAE
from ..model_loaders.var.vqvae import MultiScaleVQVAE, VQVAEConfig
from . import autoencoder_data
from .demo_common import encoding_file, psnr, save_autoencoder, to_tensor
from ..commands.training import cosine_lr, setup, Timer, train_step
from ..commands.bench.demo_data import MAR_TOKEN, make_batch
from .train_kl_vae import CONFIG as KL_CONFIG

PATCH_NUMS = (1, 2, 3, 4, 6, 8)
CONFIG = VQVAEConfig(codebook_size=512, embed_dim=KL_CONFIG.embed_dim, z_channels=KL_CONFIG.embed_dim, ch=KL_CONFIG.ch,
                     ch_mult=KL_CONFIG.ch_mult, num_res_blocks=KL_CONFIG.num_res_blocks, encoder_attn_levels=(),
                     decoder_attn_levels=(), patch_nums=PATCH_NUMS)


@torch.no_grad()
def from_kl_autoencoder(kl, cfg: VQVAEConfig = CONFIG) -> MultiScaleVQVAE:
    """A VQVAE whose encoder and decoder are the KL autoencoder's (see the module doc); codebook left random."""
    model = MultiScaleVQVAE(cfg)
    C = cfg.z_channels
    theirs = kl.state_dict()
    ours = {k: v for k, v in theirs.items() if k.startswith(("encoder.", "decoder."))}
    # the posterior mean: the KL's 1x1 quant_conv (moments -> moments) folded into its encoder's last conv
    mix, mix_bias = theirs["quant_conv.weight"][:C, :, 0, 0], theirs["quant_conv.bias"][:C]
    ours["encoder.conv_out.weight"] = torch.einsum("om,mikl->oikl", mix, theirs["encoder.conv_out.weight"])
    ours["encoder.conv_out.bias"] = mix @ theirs["encoder.conv_out.bias"] + mix_bias
    model.load_state_dict(ours, strict=False)
    identity = (torch.eye(C)[:, :, None, None], torch.zeros(C))
    for conv, (weight, bias) in ((model.quant_conv, identity),
                                 (model.post_quant_conv, (theirs["post_quant_conv.weight"], theirs["post_quant_conv.bias"]))):
        conv.weight.zero_()
        conv.weight[:, :, 1:2, 1:2] = weight
        conv.bias.copy_(bias)
    for phi in model.quantize.quant_resi.qresi_ls:  # Phi starts as the identity: 0.5 h + 0.5 conv(h), conv = id
        phi.weight.zero_()
        phi.weight[:, :, 1, 1] = torch.eye(C)
        phi.bias.zero_()
    return model


@torch.no_grad()
def latents_of(model: MultiScaleVQVAE, images: torch.Tensor) -> torch.Tensor:
    return torch.cat([model.quant_conv(model.encoder(x)).float() for x in images.split(32)])


@torch.no_grad()
def residual_pool(latents: torch.Tensor) -> torch.Tensor:
    """Vectors ``[N, C]`` of what every scale must quantise if each scale took its residual exactly (area-pooled
    residuals): where codes should start."""
    picks = []
    for pn in PATCH_NUMS:
        pooled = F.interpolate(latents, size=(pn, pn), mode="area")
        picks.append(pooled.permute(0, 2, 3, 1).reshape(-1, latents.shape[1]))
        latents = latents - F.interpolate(pooled, size=latents.shape[-2:], mode="bicubic")
    return torch.cat(picks)


def quantise(model: MultiScaleVQVAE, f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The release's residual quantisation of latents ``f`` [B, C, h, w], differentiable in the code vectors
    and the Phi convs: (f_hat, how often each code was picked [V])."""
    rest, f_hat = f, torch.zeros_like(f)
    used = torch.zeros(model.cfg.codebook_size)
    for scale, pn in enumerate(PATCH_NUMS):
        z = rest if scale + 1 == len(PATCH_NUMS) else F.interpolate(rest, size=(pn, pn), mode="area")
        codes = model.quantize.nearest(z.detach())
        used += torch.bincount(codes.flatten(), minlength=len(used)).float()
        h = model.quantize.embedding(codes).permute(0, 3, 1, 2)
        added = model.quantize.add_scale(torch.zeros_like(f), h, scale, len(PATCH_NUMS))
        f_hat, rest = f_hat + added, rest - added
    return f_hat, used


@torch.no_grad()
def reseed_dead_codes(model: MultiScaleVQVAE, used: torch.Tensor, pool: torch.Tensor, gen: torch.Generator) -> int:
    dead = (used == 0).nonzero().flatten()
    if len(dead):
        rows = torch.randint(0, len(pool), (len(dead),), generator=gen)
        model.quantize.embedding.weight[dead] = pool[rows]
    return len(dead)


@torch.no_grad()
def evaluate(model: MultiScaleVQVAE, images: torch.Tensor) -> float:
    """Mean per-image PSNR (dB) of images encoded to codes and decoded."""
    scores = []
    for x in images.split(16):
        codes = model.encode_scales(x, PATCH_NUMS)
        recon = model.decode(model.teacher_inputs(codes, PATCH_NUMS)[1])
        scores += [psnr(r[None], i[None]) for r, i in zip(recon, x)]
    return float(np.mean(scores))


def train_quantiser(model, latents, steps: int, batch: int, lr: float, gen, timer) -> None:
    params = [model.quantize.embedding.weight, *model.quantize.quant_resi.parameters()]
    opt = torch.optim.Adam(params, lr=lr)
    usage = torch.zeros(model.cfg.codebook_size)
    for step in range(steps):
        f = latents[torch.randint(0, len(latents), (batch,), generator=gen)]
        f_hat, used = quantise(model, f)
        usage += used
        loss = F.mse_loss(f_hat, f)
        train_step(opt, loss, cosine_lr(step, steps, lr, warmup=50))
        if (step + 1) % 200 == 0:
            reseeded = reseed_dead_codes(model, usage, residual_pool(f.detach()), gen) if step + 1 < steps * 0.8 else 0
            print(f"quantiser {step + 1}/{steps}: latent mse {loss.item():.4f} ({loss.item() / f.var().item():.1%} of the "
                  f"latent variance), codes used {(usage > 0).float().mean():.0%}, re-seeded {reseeded} [{timer}]", flush=True)
            usage.zero_()


def train_decoder(model, images, latents, steps: int, batch: int, lr: float, gen, timer) -> None:
    params = [*model.decoder.parameters(), *model.post_quant_conv.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    for step in range(steps):
        idx = torch.randint(0, len(images), (batch,), generator=gen)
        x = images[idx]
        with torch.no_grad():
            f_hat, _ = quantise(model, latents[idx])
        recon = model.decode(f_hat)
        loss = F.l1_loss(recon, x) + F.mse_loss(recon, x)
        train_step(opt, loss, cosine_lr(step, steps, lr, warmup=50), clip=1.0)
        if (step + 1) % 50 == 0:
            print(f"decoder {step + 1}/{steps}: loss {loss.item():.4f} [{timer}]", flush=True)


def main(argv=None):
    p = autoencoder_data.parser(__doc__, steps=300, lr=1e-4, out=str(DEMO_VAR_VQVAE), held_out=64)
    p.add_argument("--quantiser-steps", type=int, default=3000)
    p.add_argument("--quantiser-lr", type=float, default=1e-3)
    p.add_argument("--kl", default=str(DEMO_KL), help="the KL autoencoder to start from")
    args = p.parse_args(argv)

    gen = setup(args.seed)
    timer = Timer()
    model = from_kl_autoencoder(load_image_decoder(encoding_file(args.kl))).eval()
    rng = np.random.default_rng(args.seed)
    images = to_tensor(make_batch(rng, args.pool, token=MAR_TOKEN)[0])
    held_out = to_tensor(make_batch(np.random.default_rng(10_000 + args.seed), args.held_out, token=MAR_TOKEN)[0])
    latents = latents_of(model, images)
    pool = residual_pool(latents)
    model.quantize.embedding.weight.data.copy_(pool[torch.randint(0, len(pool), (CONFIG.codebook_size,), generator=gen)])
    print(f"VQVAE {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params from {Path(args.kl).name}; {len(images)} images "
          f"encoded; seeded codebook: held-out PSNR {evaluate(model, held_out):.2f} dB [{timer}]", flush=True)
    train_quantiser(model, latents, args.quantiser_steps, 256, args.quantiser_lr, gen, timer)
    print(f"after the quantiser: held-out PSNR {evaluate(model, held_out):.2f} dB [{timer}]", flush=True)
    model.decoder.train()
    train_decoder(model, images, latents, args.steps, args.batch, args.lr, gen, timer)
    model.eval()
    whole = save_autoencoder(model, CONFIG, args.out)
    print(f"held-out PSNR (fp16 weights, {len(held_out)} images): {evaluate(load_image_decoder(whole), held_out):.2f} dB; "
          f"total {timer}")


if __name__ == "__main__":
    main()
