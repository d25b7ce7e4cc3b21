"""The demo classifier: a small CNN that names the class of a 128px demo image.

Benchmarks use it to measure class agreement of generated samples and, through its penultimate
features, a Frechet distance between generated and real images (an FID for the demo data set).
"""
from __future__ import annotations

import json

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from ...model_loaders.shared.demo import DEMO_CLASSIFIER


def _stage(cin: int, cout: int, pool: bool) -> nn.Sequential:
    layers = [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]
    return nn.Sequential(*layers, nn.MaxPool2d(2)) if pool else nn.Sequential(*layers)


class DemoClassifier(nn.Module):
    """Images [B, 3, 128, 128] in [-1, 1] -> (logits [B, classes], features [B, width*4])."""

    def __init__(self, num_classes: int = 8, width: int = 32):
        super().__init__()
        self.config = {"num_classes": num_classes, "width": width}
        self.body = nn.Sequential(
            nn.AvgPool2d(2),  # 64px is plenty for these shapes and 4x cheaper
            _stage(3, width, True), _stage(width, 2 * width, True), _stage(2 * width, 4 * width, True),
            _stage(4 * width, 4 * width, False), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, x):
        features = self.body(x)
        return self.head(features), features


def load_classifier(path=DEMO_CLASSIFIER, device="cpu") -> DemoClassifier:
    with safe_open(str(path), "pt") as f:
        config = json.loads(f.metadata()["fastar_config"])
    model = DemoClassifier(config["num_classes"], config["width"])
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in load_file(str(path)).items()})
    return model.to(device).eval()


def as_model_input(images, device) -> torch.Tensor:
    """uint8 [B, H, W, 3] (numpy or torch) or float [B, 3, H, W] in [-1, 1] -> float on ``device``."""
    x = torch.as_tensor(np.asarray(images)) if not torch.is_tensor(images) else images
    if x.dtype == torch.uint8:
        x = x.permute(0, 3, 1, 2).float() / 127.5 - 1.0
    return x.to(device=device, dtype=torch.float32).clamp(-1, 1).contiguous()


@torch.no_grad()
def classify(model: DemoClassifier, images, batch: int = 64):
    """(predicted labels [B] int64, penultimate features [B, D] float32), both on the CPU."""
    device = next(model.parameters()).device
    preds, feats = [], []
    for chunk in range(0, len(images), batch):
        logits, f = model(as_model_input(images[chunk : chunk + batch], device))
        preds.append(logits.argmax(-1).cpu())
        feats.append(f.float().cpu())
    return torch.cat(preds), torch.cat(feats)


def frechet_distance(feats_a, feats_b) -> float:
    """Frechet distance between Gaussians fitted to two feature sets [N, D] (the FID formula).

    tr sqrt(A B) is computed as tr sqrt(A^1/2 B A^1/2): that matrix is symmetric positive semi-definite,
    so symmetric eigendecompositions suffice (no scipy), and the singular covariances of few samples
    need no regularisation (their negative rounding-error eigenvalues are clipped to 0)."""
    a, b = (np.asarray(torch.as_tensor(f).double()) for f in (feats_a, feats_b))
    mu_a, mu_b = a.mean(0), b.mean(0)
    cov_a, cov_b = np.atleast_2d(np.cov(a, rowvar=False)), np.atleast_2d(np.cov(b, rowvar=False))
    root_a = psd_sqrt(cov_a)
    middle = root_a @ cov_b @ root_a
    trace_covmean = np.sqrt(np.linalg.eigvalsh((middle + middle.T) / 2).clip(min=0.0)).sum()
    diff = mu_a - mu_b
    return float(max(diff @ diff + np.trace(cov_a) + np.trace(cov_b) - 2 * trace_covmean, 0.0))


def psd_sqrt(matrix: np.ndarray) -> np.ndarray:
    """The symmetric square root of a positive semi-definite matrix."""
    values, vectors = np.linalg.eigh(matrix)
    return (vectors * np.sqrt(values.clip(min=0.0))) @ vectors.T
