"""Check the bundled demo models end to end: sampling (plain AR, or a Jacobi decoder) -> VQ decode ->
classifier agreement.

    python -m fastar.tools.check_demo [--decoder ar|sjd|gsd] [--samples N] [--cfg 2.0] [--top-k 0]

Agreement = share of samples whose requested class is the classifier's prediction (balanced classes).
Also reports the Frechet distance to real images in classifier-feature space and writes a grid PNG
(one row per class) under ``out/``.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from ..model_loaders import load_ar_model, load_vq_model
from ..model_loaders.demo import DEMO_AR, DEMO_CLASSIFIER, DEMO_VQ
from ..model_loaders.protocol import ClassConditioning
from ..pipeline import codes_to_images
from ..samplers.decoders import DecoderSpec, decode
from ..samplers.processing import SamplingSettings
from .classifier import classify, frechet_distance, load_classifier
from .demo_common import OUT_DIR, Timer, setup
from .demo_data import CLASS_NAMES, balanced_labels, make_batch


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decoder", choices=("ar", "sjd", "gsd"), default="ar", help="with its default settings")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--cfg", type=float, default=2.0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ar", default=str(DEMO_AR))
    p.add_argument("--vq", default=str(DEMO_VQ))
    p.add_argument("--classifier", default=str(DEMO_CLASSIFIER))
    args = p.parse_args(argv)

    setup(args.seed)
    timer = Timer()
    model, vq, clf = load_ar_model(args.ar), load_vq_model(args.vq), load_classifier(args.classifier)
    sampling = SamplingSettings(cfg_scale=args.cfg, temperature=args.temperature, top_k=args.top_k).validate()
    labels = torch.from_numpy(balanced_labels(args.samples))
    images = []
    for i, chunk in enumerate(labels.split(args.batch)):
        codes, _ = decode(model, ClassConditioning(chunk), sampling, DecoderSpec(args.decoder),
                          seed=args.seed + i)
        images.append(codes_to_images(vq, codes, model.grid))
    images = np.concatenate(images)
    pred, feats = classify(clf, images)
    agree = pred == labels
    real, real_labels = make_batch(np.random.default_rng(20_000 + args.seed), args.samples, balanced_labels(args.samples))
    _, real_feats = classify(clf, real)
    print(f"{args.decoder}, cfg {args.cfg} temperature {args.temperature} top-k {args.top_k}: "
          f"agreement {agree.float().mean():.3f} on {args.samples} samples, "
          f"Frechet distance to real {frechet_distance(feats, real_feats):.2f} [{timer}]")
    for k, name in enumerate(CLASS_NAMES):
        print(f"  {name:>12}: {agree[labels == k].float().mean():.2f}")

    # grid: one row per class, as many columns as samples per class (at most 8)
    cols = min(8, args.samples // len(CLASS_NAMES))
    if cols:
        rows = [np.concatenate([images[labels.numpy() == k][c] for c in range(cols)], 1) for k in range(len(CLASS_NAMES))]
        OUT_DIR.mkdir(exist_ok=True)
        from PIL import Image

        path = OUT_DIR / f"demo_samples_{args.decoder}_cfg{args.cfg}_k{args.top_k}.png"
        Image.fromarray(np.concatenate(rows, 0)).save(path)
        print(f"grid: {path}")


if __name__ == "__main__":
    main()
