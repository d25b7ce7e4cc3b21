"""Train the demo classifier, the judge of generated samples, on real procedural images only.

    python -m fastar.demo_recipes.train_classifier [--steps N] [--out PATH]

It never sees a VQ reconstruction or a generated sample: a judge that learnt what the generator's
failures look like would accept them (an earlier judge, trained partly on reconstructions, called smeared
blobs circles). Flips, brightness jitter and pixel noise keep it from keying on exact colours or
razor-sharp edges. Its accuracy on VQ reconstructions of held-out images is reported, not trained for.
``--texture LEVELS``: half of every batch textured (demo_data), half flat, so that one judge reads the textured
demo and the flat ones alike.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.nn.functional as F

from ..model_loaders.shared.demo import DEMO_CLASSIFIER, DEMO_VQ
from ..commands.bench.classifier import DemoClassifier, classify, load_classifier
from ..model_loaders import load_image_decoder
from .demo_common import encoding_file, to_tensor
from ..errors import FastARError
from ..commands.training import cosine_lr, save_fp16, setup, Timer, train_step
from ..commands.bench.demo_data import CLASS_NAMES, TEXTURE_LEVELS, balanced_labels, make_batch


@torch.no_grad()
def reconstruct(vq, images: torch.Tensor) -> torch.Tensor:
    return torch.cat([vq.decode_codes(vq.encode(x)).clamp(-1, 1) for x in images.split(32)])


def augment(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    b = x.shape[0]
    flip = torch.rand(b, generator=gen) < 0.5
    x = torch.where(flip[:, None, None, None], x.flip(-1), x)
    x = x * (1 + 0.2 * (torch.rand(b, 1, 1, 1, generator=gen) - 0.5)) + 0.2 * (torch.rand(b, 3, 1, 1, generator=gen) - 0.5)
    return (x + 0.05 * torch.rand(b, 1, 1, 1, generator=gen) * torch.randn(x.shape, generator=gen)).clamp(-1, 1)


def training_batch(rng, batch: int, texture: float):
    """``batch`` real images and labels: all flat, or with ``texture``, the second half textured."""
    if texture == 0:
        return make_batch(rng, batch)
    flat, textured = make_batch(rng, batch // 2), make_batch(rng, batch - batch // 2, texture=texture)
    return np.concatenate([flat[0], textured[0]]), np.concatenate([flat[1], textured[1]])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--texture", type=float, default=TEXTURE_LEVELS,
                   help="texture half of the images, its largest excursion in 8-bit levels (0: all flat)")
    p.add_argument("--vq", default=str(DEMO_VQ))
    p.add_argument("--out", default=str(DEMO_CLASSIFIER))
    args = p.parse_args(argv)

    gen = setup(args.seed)
    rng = np.random.default_rng(args.seed)
    timer = Timer()
    model = DemoClassifier(len(CLASS_NAMES))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    for step in range(args.steps):
        real, y_real = training_batch(rng, args.batch, args.texture / 255)
        x, y = augment(to_tensor(real), gen), torch.from_numpy(y_real)
        logits, _ = model(x)
        loss = F.cross_entropy(logits, y)
        train_step(opt, loss, cosine_lr(step, args.steps, args.lr, warmup=50, floor=0.01))
        if (step + 1) % 50 == 0:
            acc = (logits.argmax(-1) == y).float().mean().item()
            print(f"step {step + 1}/{args.steps} loss {loss.item():.4f} batch acc {acc:.3f} [{timer}]", flush=True)

    model.eval()
    save_fp16(model, model.config | {"class_names": list(CLASS_NAMES)}, args.out)
    saved = load_classifier(args.out)
    held_rng = np.random.default_rng(10_000 + args.seed)
    test, y_test = make_batch(held_rng, 256, balanced_labels(256))
    y_test = torch.from_numpy(y_test)
    pred_real, _ = classify(saved, test)
    print(f"held-out accuracy (fp16 weights, 256 balanced images): real {(pred_real == y_test).float().mean():.3f}")
    try:
        vq = load_image_decoder(encoding_file(args.vq))
    except FastARError as e:
        print(f"VQ reconstructions not checked: {e}")
    else:
        pred_recon, _ = classify(saved, reconstruct(vq, to_tensor(test)))
        print(f"  VQ-reconstructed {(pred_recon == y_test).float().mean():.3f} (a check, not trained for)")
    print(f"total {timer}")


if __name__ == "__main__":
    main()
