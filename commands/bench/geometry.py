"""How true a sample's shape is: the IoU between its foreground and the ideal shape of its class that fits it
best (a disc, an upright square, an annulus). A round circle, a square square and a closed ring of the demo data
score 0.95 or more; a lumpy circle, a square with a bulge or a broken ring score less. Class agreement cannot
see this: the judge names a lumpy circle a circle.

The foreground is read through demo_data's palettes: the background is the RGB corner most border pixels are
nearest to, the foreground every pixel nearer to the opposite corner than to it.
"""
from __future__ import annotations

import numpy as np

from .demo_data import CLASS_NAMES, HIGH, LOW, SIZE

FITTED = ("circle", "square", "ring")  # the classes with one ideal shape to fit (triangles and crosses vary more)

_Y, _X = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32) + 0.5


def foreground(image: np.ndarray) -> np.ndarray:
    """bool [H, W]: the pixels of ``image`` (uint8 [H, W, 3]) nearer the foreground colour than the background's."""
    x = image.astype(np.float32) / 255
    corners = x > 0.5  # each pixel's nearest RGB corner
    border = np.concatenate([corners[0], corners[-1], corners[:, 0], corners[:, -1]])
    codes, counts = np.unique(border @ np.array([4, 2, 1]), return_counts=True)
    bits = (codes[counts.argmax()] >> np.array([2, 1, 0])) & 1
    background, foreground_colour = LOW + (HIGH - LOW) * bits, LOW + (HIGH - LOW) * (1 - bits)
    return ((x - foreground_colour) ** 2).sum(-1) < ((x - background) ** 2).sum(-1)


def _disc(cx, cy, r):
    return (_X - cx) ** 2 + (_Y - cy) ** 2 <= r * r


def _square(cx, cy, half):
    return np.maximum(np.abs(_X - cx), np.abs(_Y - cy)) <= half


def _annulus(cx, cy, inner, outer):
    d2 = (_X - cx) ** 2 + (_Y - cy) ** 2
    return (d2 <= outer * outer) & (d2 >= inner * inner)


_SHAPES = {"circle": _disc, "square": _square, "ring": _annulus}


def _iou(a: np.ndarray, b: np.ndarray) -> float:
    union = np.logical_or(a, b).sum()
    return float(np.logical_and(a, b).sum() / union) if union else 0.0


def _first_guess(kind: str, mask: np.ndarray) -> list[float]:
    """The shape's parameters from the mask's moments: its centroid, and sizes from its area (and, for a ring,
    the mean squared radius: an annulus of radii a < b has area pi (b^2 - a^2) and mean r^2 (a^2 + b^2) / 2)."""
    area = mask.sum()
    cx, cy = _X[mask].mean(), _Y[mask].mean()
    if kind == "circle":
        return [cx, cy, np.sqrt(area / np.pi)]
    if kind == "square":
        return [cx, cy, np.sqrt(area) / 2]
    mean_r2 = ((_X[mask] - cx) ** 2 + (_Y[mask] - cy) ** 2).mean()
    half_spread = area / (2 * np.pi)
    return [cx, cy, np.sqrt(max(mean_r2 - half_spread, 0.0)), np.sqrt(mean_r2 + half_spread)]


def best_fit_iou(mask: np.ndarray, kind: str) -> float:
    """The IoU of ``mask`` with the ``kind`` shape that overlaps it best: the moments' guess, then coordinate
    ascent on each parameter in steps of 2, 1 and 0.5 pixels."""
    if mask.sum() < 16:  # nothing drawn
        return 0.0
    draw = _SHAPES[kind]
    params = _first_guess(kind, mask)
    best = _iou(mask, draw(*params))
    for step in (2.0, 1.0, 0.5):
        improved = True
        while improved:
            improved = False
            for i in range(len(params)):
                for sign in (1, -1):
                    trial = list(params)
                    trial[i] += sign * step
                    score = _iou(mask, draw(*trial))
                    if score > best + 1e-9:
                        params, best, improved = trial, score, True
    return best


def shape_fidelity(images: np.ndarray, labels) -> dict[str, float]:
    """Mean best-fit IoU per fitted class (``FITTED``) over the images of that class; classes absent are left out."""
    labels = np.asarray(labels)
    scores = {}
    for kind in FITTED:
        picked = np.flatnonzero(labels == CLASS_NAMES.index(kind))
        if len(picked):
            scores[kind] = float(np.mean([best_fit_iou(foreground(images[i]), kind) for i in picked]))
    return scores
