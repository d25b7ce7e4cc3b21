"""Train the demo VAR's multi-scale VQVAE (VAR's VQVAE format, 128px -> 8x8 f_hat of 16 channels, scales
1, 2, 3, 4, 6, 8).

    python -m fastar.tools.train_var_vqvae [--steps N] [--out PATH]

It starts from the demo KL autoencoder (the same LDM encoder and decoder: the encoder's mean half becomes the
latent, the 1x1 convs the centre taps of the VQVAE's 3x3 ones), so the minutes go to the quantiser: the
codebook starts from k-means-like picks of latents at every scale, and training is the release's recipe
(reconstruction of the image decoded from f_hat with straight-through gradients, plus per-scale commitment
beta 0.25 and codebook terms on f_hat). Random 64x64 crops (the nets are convolutional).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..model_loaders import load_image_decoder
from ..model_loaders.demo import DEMO_KL, DEMO_VAR_VQVAE
from ..model_loaders.var_vqvae import MultiScaleVQVAE, VQVAEConfig
from . import autoencoder_data
from .demo_common import Timer, cosine_lr, psnr, save_fp16, setup
from .train_kl_vae import CONFIG as KL_CONFIG

PATCH_NUMS = (1, 2, 3, 4, 6, 8)
CONFIG = VQVAEConfig(codebook_size=512, embed_dim=KL_CONFIG.embed_dim, z_channels=KL_CONFIG.embed_dim, ch=KL_CONFIG.ch,
                     ch_mult=KL_CONFIG.ch_mult, num_res_blocks=KL_CONFIG.num_res_blocks, encoder_attn_levels=(),
                     decoder_attn_levels=(), patch_nums=PATCH_NUMS)
BETA = 0.25  # the release's commitment weight


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
def seed_codebook(model: MultiScaleVQVAE, images: torch.Tensor, generator: torch.Generator) -> None:
    """Codebook rows drawn from the latents of every scale's residual (area-pooled), so that each scale finds
    codes near what it must quantise from the first step."""
    latents = model.quant_conv(model.encoder(images)).float()
    picks = []
    for pn in PATCH_NUMS:
        pooled = F.interpolate(latents, size=(pn, pn), mode="area").permute(0, 2, 3, 1).reshape(-1, latents.shape[1])
        picks.append(pooled)
        latents = latents - F.interpolate(F.interpolate(latents, size=(pn, pn), mode="area"), size=latents.shape[-2:],
                                          mode="bicubic")
    pool = torch.cat(picks)
    rows = torch.randint(0, len(pool), (model.cfg.codebook_size,), generator=generator)
    model.quantize.embedding.weight.copy_(pool[rows] + 0.01 * torch.randn(len(rows), pool.shape[1], generator=generator))


def quantise(model: MultiScaleVQVAE, f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The release's residual quantisation of latents ``f`` with gradients: (f_hat with straight-through
    gradients to the encoder, the VQ loss, codebook usage [V])."""
    rest, f_hat, vq_loss = f, torch.zeros_like(f), 0.0
    used = torch.zeros(model.cfg.codebook_size)
    for scale, pn in enumerate(PATCH_NUMS):
        z = rest if scale + 1 == len(PATCH_NUMS) else F.interpolate(rest, size=(pn, pn), mode="area")
        codes = model.quantize.nearest(z.detach())
        used += torch.bincount(codes.flatten().cpu(), minlength=len(used)).float()
        h = model.quantize.embedding(codes).permute(0, 3, 1, 2)
        added = model.quantize.add_scale(torch.zeros_like(f), h, scale, len(PATCH_NUMS))
        f_hat = f_hat + added
        rest = rest - added
        vq_loss = vq_loss + F.mse_loss(f_hat, f.detach()) + BETA * F.mse_loss(f_hat.detach(), f)
    return f + (f_hat - f).detach(), vq_loss / len(PATCH_NUMS), used


@torch.no_grad()
def evaluate(model: MultiScaleVQVAE, images: torch.Tensor) -> dict:
    recon = []
    for x in images.split(16):
        codes = model.encode_scales(x, PATCH_NUMS)
        recon.append(model.decode(model.teacher_inputs(codes, PATCH_NUMS)[1]).clamp(-1, 1))
    recon = torch.cat(recon)
    return {"psnr": float(np.mean([psnr(r[None], x[None]) for r, x in zip(recon, images)])), "recon": recon}


def main(argv=None):
    p = autoencoder_data.parser(__doc__, steps=1200, lr=3e-4, out=str(DEMO_VAR_VQVAE))
    p.add_argument("--kl", default=str(DEMO_KL), help="the KL autoencoder to start from")
    args = p.parse_args(argv)

    gen = setup(args.seed)
    timer = Timer()
    rng, pool, held_out = autoencoder_data.images(args.seed, args.pool)
    model = from_kl_autoencoder(load_image_decoder(args.kl))
    seed_codebook(model, autoencoder_data.crop_batch(pool, rng, 256, 128), gen)
    print(f"VQVAE {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, from {args.kl}; before training: "
          f"held-out PSNR {evaluate(model.eval(), held_out[:64])['psnr']:.2f} dB [{timer}]", flush=True)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    usage = torch.zeros(CONFIG.codebook_size)
    for step in range(args.steps):
        x = autoencoder_data.crop_batch(pool, rng, args.batch, args.crop)
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, args.steps, args.lr, warmup=100)
        f_hat, vq_loss, used = quantise(model, model.quant_conv(model.encoder(x)))
        usage += used
        recon = model.decode(f_hat)
        rec_loss = F.l1_loss(recon, x) + F.mse_loss(recon, x)
        loss = rec_loss + vq_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % 50 == 0:
            print(f"step {step + 1}/{args.steps} loss {loss.item():.4f} rec {rec_loss.item():.4f} vq {vq_loss.item():.4f} "
                  f"codes used {(usage > 0).float().mean():.1%} [{timer}]", flush=True)
            usage.zero_()
    model.eval()
    save_fp16(model, CONFIG, args.out)
    result = evaluate(load_image_decoder(args.out), held_out)
    print(f"held-out (fp16 weights, {autoencoder_data.HELD_OUT} images): PSNR {result['psnr']:.2f} dB per image; "
          f"total {timer}")


if __name__ == "__main__":
    main()
