"""Check the bundled demo models end to end: sampling -> image decoder -> classifier agreement.

    python -m fastar.demo_recipes.check_demo [--decoder ar|sjd|gsd] [--samples N] [--cfg 2.0] [--top-k 0]
    python -m fastar.demo_recipes.check_demo --mar [--decoder ar|cspd] [--num-iter 64] [--cfg-schedule linear]
    python -m fastar.demo_recipes.check_demo --text [--decoder ar|sjd|gsd]   # the text demo, prompts with colours

Agreement = share of samples whose requested class is the classifier's prediction (balanced classes); for
the text demo, prompts name the shape and the colours ("a red ring on a cyan background", colours drawn at
random), and colour agreement is the share of samples whose two most common RGB corners are the prompted pair.
Also reports the Frechet distance to real images in classifier-feature space, how true the circles, squares and
rings are (``geometry.shape_fidelity``, beside the real images' own) and writes a grid PNG (one row per class)
under ``out/``.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from ..model_loaders import load_ar_model, load_image_decoder
from ..model_loaders.shared.demo import DEMO_AR, DEMO_CLASSIFIER, DEMO_KL, DEMO_MAR, DEMO_MAR_DRAFT, DEMO_TEXT, DEMO_VQ, DEMO_VQGAN
from ..model_loaders.drafters.loader import load_drafter
from ..model_loaders.shared.protocol import ClassConditioning, PromptConditioning
from ..model_loaders.shared.quantized import WEIGHT_FORMATS
from ..pipeline import outputs_to_images
from ..samplers.masked_loops.cspd import CSpDSettings
from ..samplers.decoders import DecoderSpec, decode, decode_masked
from ..samplers.masked_loops.masked import MaskedSettings
from ..samplers.processing import SamplingSettings
from ..commands.bench.classifier import classify, frechet_distance, load_classifier
from .demo_common import OUT_DIR
from ..commands.training import setup, Timer
from ..commands.bench.demo_data import CLASS_NAMES, MAR_TOKEN, TEXTURE_LEVELS, balanced_labels, caption, make_batch
from ..commands.bench.geometry import shape_fidelity


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decoder", choices=("ar", "sjd", "gsd", "cspd"), default="ar", help="with its default settings")
    p.add_argument("--mar", action="store_true", help="check the demo MAR (KL autoencoder, MAR target and draft)")
    p.add_argument("--text", action="store_true", help="check the text demo (Lumina-mGPT format, prompts)")
    p.add_argument("--num-iter", type=int, default=64, help="MAR steps")
    p.add_argument("--cfg-schedule", default="linear", help="MAR: linear or constant")
    p.add_argument("--diffusion-steps", type=int, default=100, help="MAR")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--cfg", type=float, default=2.0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ar", help="the model to check (default: the demo model, or with --mar the demo MAR)")
    p.add_argument("--vq", help="its image decoder (default: the demo VQ, or with --mar the demo KL autoencoder)")
    p.add_argument("--classifier", default=str(DEMO_CLASSIFIER))
    p.add_argument("--weights", choices=WEIGHT_FORMATS, default="auto",
                   help="the model's (and MAR draft's) blocks in 8 bits; token models also report how often its "
                        "likeliest next code is the full-precision model's along the samples")
    p.add_argument("--texture", type=float,
                   help="the real images' texture in 8-bit levels, as the checked model's data had it (default: "
                        f"{TEXTURE_LEVELS} for the class and text demos, 0 with --mar)")
    args = p.parse_args(argv)

    setup(args.seed)
    timer = Timer()
    args.ar = args.ar or str(DEMO_MAR if args.mar else DEMO_TEXT if args.text else DEMO_AR)
    args.vq = args.vq or str(DEMO_KL if args.mar else DEMO_VQGAN if args.text else DEMO_VQ)
    model, vq, clf = load_ar_model(args.ar, args.weights), load_image_decoder(args.vq), load_classifier(args.classifier)
    labels = torch.from_numpy(balanced_labels(args.samples))
    backgrounds = np.random.default_rng(30_000 + args.seed).integers(0, 2, (args.samples, 3))
    captions = [caption(int(y), b) for y, b in zip(labels, backgrounds)]
    images, agreements = [], []
    full = load_ar_model(args.ar) if args.weights != "auto" and not args.mar else None
    for i, chunk in enumerate(labels.split(args.batch)):
        rows = (PromptConditioning(captions[i * args.batch: i * args.batch + len(chunk)]) if args.text
                else ClassConditioning(chunk))
        outputs = sample(args, model, rows, args.seed + i)
        images.append(outputs_to_images(vq, model, outputs))
        if full is not None:
            agreements.append(next_token_agreement((full, model), rows, outputs))
    images = np.concatenate(images)
    if agreements:
        print(f"{args.weights} weights: the likeliest next code is the full-precision model's at "
              f"{np.mean(agreements):.4f} of the positions along the samples")
    if args.text:
        colours = np.mean([colour_pair(image) == {tuple(b), tuple(1 - b)} for image, b in zip(images, backgrounds)])
        print(f"colour agreement {colours:.3f} (the two most common RGB corners are the prompted pair)")
    pred, feats = classify(clf, images)
    agree = pred == labels
    texture = (0 if args.mar else TEXTURE_LEVELS) if args.texture is None else args.texture
    real, real_labels = make_batch(np.random.default_rng(20_000 + args.seed), args.samples, balanced_labels(args.samples),
                                   token=MAR_TOKEN if args.mar else 8, texture=texture / 255)  # as the model's data
    _, real_feats = classify(clf, real)
    print(f"{args.decoder}, cfg {args.cfg} temperature {args.temperature} top-k {args.top_k}: "
          f"agreement {agree.float().mean():.3f} on {args.samples} samples, "
          f"Frechet distance to real {frechet_distance(feats, real_feats):.2f} [{timer}]")
    for k, name in enumerate(CLASS_NAMES):
        print(f"  {name:>12}: {agree[labels == k].float().mean():.2f}")
    fidelity, real_fidelity = shape_fidelity(images, labels.numpy()), shape_fidelity(real, real_labels)
    print("shape fidelity (IoU with the best-fitting true shape; real images in brackets): "
          + ", ".join(f"{kind} {fidelity[kind]:.3f} ({real_fidelity[kind]:.3f})" for kind in fidelity))

    # grid: one row per class, as many columns as samples per class (at most 8)
    cols = min(8, args.samples // len(CLASS_NAMES))
    if cols:
        rows = [np.concatenate([images[labels.numpy() == k][c] for c in range(cols)], 1) for k in range(len(CLASS_NAMES))]
        OUT_DIR.mkdir(exist_ok=True)
        from PIL import Image

        kind = "mar_" if args.mar else "text_" if args.text else ""
        steps = f"_iter{args.num_iter}" if args.mar else ""
        name = (f"{kind}{args.decoder}{steps}_cfg{args.cfg}" + ("" if args.mar else f"_k{args.top_k}")
                + ("" if args.weights == "auto" else f"_{args.weights}"))
        path = OUT_DIR / f"demo_samples_{name}.png"
        Image.fromarray(np.concatenate(rows, 0)).save(path)
        print(f"grid: {path}")


@torch.no_grad()
def next_token_agreement(models, conditioning, codes: torch.Tensor) -> float:
    """The share of positions where both models' likeliest next code (conditional logits) is the same, each fed
    ``codes`` (teacher forcing: decoded apart, two models part at their first different token)."""
    picks = []
    for model in models:
        session = model.start(conditioning, cfg=False, max_window=codes.shape[1])
        rest = session.forward(codes[:, :-1], torch.zeros(len(codes), dtype=torch.long, device=codes.device))
        picks.append(torch.cat([session.first.cond, rest.cond], 1).argmax(-1))
    return (picks[0] == picks[1]).float().mean().item()


def colour_pair(image: np.ndarray) -> set:
    """The two most common RGB corners (0/1 per channel) among an image's pixels."""
    corners = (image.reshape(-1, 3) > 127).astype(int)
    values, counts = np.unique(corners, axis=0, return_counts=True)
    return {tuple(int(c) for c in values[i]) for i in np.argsort(-counts)[:2]}


def sample(args, model, conditioning, seed: int):
    if args.mar:
        settings = MaskedSettings(num_iter=args.num_iter, cfg_scale=args.cfg, cfg_schedule=args.cfg_schedule,
                                  temperature=args.temperature, diffusion_steps=args.diffusion_steps)
        draft = load_drafter(DEMO_MAR_DRAFT, model, weights=args.weights) if args.decoder == "cspd" else None
        return decode_masked(model, conditioning, settings, args.decoder, seed=seed, cspd=CSpDSettings(),
                             drafter=draft)[0]
    sampling = SamplingSettings(cfg_scale=args.cfg, temperature=args.temperature, top_k=args.top_k).validate()
    return decode(model, conditioning, sampling, DecoderSpec(args.decoder), seed=seed)[0]


if __name__ == "__main__":
    main()
