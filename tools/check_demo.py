"""Check the bundled demo models end to end: plain AR sampling -> VQ decode -> classifier agreement.

    python -m fastar.tools.check_demo [--samples N] [--cfg 4.0] [--top-k 20]

Agreement = share of samples whose requested class is the classifier's prediction (balanced classes).
Also reports the Frechet distance to real images in classifier-feature space and writes a grid PNG
(one row per class) under ``out/``.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from ..model_loaders.demo import DEMO_AR, DEMO_CLASSIFIER, DEMO_VQ
from ..model_loaders.protocol import ClassConditioning
from .classifier import classify, frechet_distance, load_classifier
from .demo_common import OUT_DIR, Timer, load_ar, load_vq, setup, to_uint8
from .demo_data import CLASS_NAMES, balanced_labels, make_batch


@torch.no_grad()
def sample(model, labels: torch.Tensor, cfg: float, temperature: float, top_k: int, gen: torch.Generator):
    """Plain token-by-token sampling with classifier-free guidance; codes [B, h, w]."""
    session = model.start(ClassConditioning(labels), cfg=True, max_window=1)
    out, codes = session.first, []
    for i in range(model.cfg.num_tokens):
        logits = (out.uncond + (out.cond - out.uncond) * cfg)[:, -1] / temperature
        if top_k:
            kth = logits.topk(top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        token = torch.multinomial(logits.softmax(-1), 1, generator=gen)
        codes.append(token)
        if i + 1 < model.cfg.num_tokens:
            out = session.forward(token, torch.full_like(labels, i))
    return torch.cat(codes, 1).view(-1, *model.cfg.grid)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--cfg", type=float, default=4.0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=20, help="0 = off; 20 gave the best agreement")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ar", default=str(DEMO_AR))
    p.add_argument("--vq", default=str(DEMO_VQ))
    p.add_argument("--classifier", default=str(DEMO_CLASSIFIER))
    args = p.parse_args(argv)

    gen = setup(args.seed)
    timer = Timer()
    model, vq, clf = load_ar(args.ar), load_vq(args.vq), load_classifier(args.classifier)
    labels = torch.from_numpy(balanced_labels(args.samples))
    images = []
    for chunk in labels.split(args.batch):
        codes = sample(model, chunk, args.cfg, args.temperature, args.top_k, gen)
        images.append(vq.decode_codes(codes).clamp(-1, 1))
    images = torch.cat(images)
    pred, feats = classify(clf, images)
    agree = pred == labels
    real, real_labels = make_batch(np.random.default_rng(20_000 + args.seed), args.samples, balanced_labels(args.samples))
    _, real_feats = classify(clf, real)
    print(f"cfg {args.cfg} temperature {args.temperature} top-k {args.top_k}: "
          f"agreement {agree.float().mean():.3f} on {args.samples} samples, "
          f"Frechet distance to real {frechet_distance(feats, real_feats):.2f} [{timer}]")
    for k, name in enumerate(CLASS_NAMES):
        print(f"  {name:>12}: {agree[labels == k].float().mean():.2f}")

    # grid: one row per class, as many columns as samples per class (at most 8)
    cols = min(8, args.samples // len(CLASS_NAMES))
    if cols:
        pix = to_uint8(images)
        rows = [np.concatenate([pix[labels.numpy() == k][c] for c in range(cols)], 1) for k in range(len(CLASS_NAMES))]
        OUT_DIR.mkdir(exist_ok=True)
        from PIL import Image

        path = OUT_DIR / f"demo_samples_cfg{args.cfg}_k{args.top_k}.png"
        Image.fromarray(np.concatenate(rows, 0)).save(path)
        print(f"grid: {path}")


if __name__ == "__main__":
    main()
