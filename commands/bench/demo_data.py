"""Procedural 128x128 RGB images in 8 classes: the training data of the bundled demo models.

Every image is drawn from a ``numpy.random.Generator``, so a seed fixes the data set. Shapes are
signed-distance masks with a one-pixel soft edge, painted in one colour over a flat background of the
complementary colour; colours, position, size and period vary within a class, and stripes and
checkerboards turn. Squares, triangles and crosses stand upright and stripe/checker cells span at least
two 8-pixel tokens: a small AR model trained for minutes on a CPU then draws them crisply.

``texture``: luminance texture over both regions (``texture_field``: grain within a token and blotches across
tokens), different in every image, the way photographs carry texture that many codes encode about equally well
and that ties neighbouring codes together: it is what makes a real AR model's next token ambiguous (LANTERN's
"token selection ambiguity") and hard for a small drafter to guess. 0 draws the flat images the first demo models were
trained on (and draws nothing from the generator for it, so their data sets stay the same).
"""
from __future__ import annotations

import numpy as np

SIZE = 128
CLASS_NAMES = ["circle", "square", "triangle", "stripes", "checkerboard", "ring", "cross", "blob"]

_Y, _X = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32) + 0.5


def _col(a: np.ndarray) -> np.ndarray:
    """Per-image parameters [n] -> [n, 1, 1] to broadcast over the pixel grid."""
    return a.astype(np.float32)[:, None, None]


def _frame(rng, n, min_r, max_r, max_angle):
    """Rotated coordinates around a random centre, and a radius (all in pixels)."""
    r = rng.uniform(min_r, max_r, n)
    cx, cy = (rng.uniform(r + 4, SIZE - r - 4) for _ in range(2))
    theta = rng.uniform(-max_angle, max_angle, n)
    c, s = _col(np.cos(theta)), _col(np.sin(theta))
    dx, dy = _X - _col(cx), _Y - _col(cy)
    return c * dx + s * dy, -s * dx + c * dy, _col(r)


def _fill(d):
    """Signed distance (negative inside) -> coverage in [0, 1], antialiased over one pixel."""
    return np.clip(0.5 - d, 0.0, 1.0)


def _circle(rng, n, token):
    u, v, r = _frame(rng, n, max(14, 1.5 * token), 44, 0)
    return _fill(np.sqrt(u * u + v * v) - r)


def _square(rng, n, token):
    u, v, r = _frame(rng, n, max(12, 1.25 * token), 38, 0)
    return _fill(np.maximum(np.abs(u), np.abs(v)) - r)


def _triangle(rng, n, token):
    u, v, r = _frame(rng, n, max(18, 2 * token), 48, 0)
    # equilateral, pointing down: intersection of three half-planes at distance r/2 from the centre
    d = np.maximum(np.maximum(-v, 0.866 * u + 0.5 * v), -0.866 * u + 0.5 * v) - r / 2
    return _fill(d)


def _ring(rng, n, token):
    u, v, r = _frame(rng, n, max(20, 1.75 * token), 46, 0)
    width = r * _col(rng.uniform(max(0.15, token / 64), 0.3, n))
    return _fill(np.abs(np.sqrt(u * u + v * v) - r) - width)


def _cross(rng, n, token):
    u, v, r = _frame(rng, n, max(20, 1.75 * token), 46, 0)
    w = r * _col(rng.uniform(0.2, 0.35, n))
    au, av = np.abs(u), np.abs(v)
    return _fill(np.minimum(np.maximum(au - r, av - w), np.maximum(au - w, av - r)))


def _waves(rng, n, max_angle, token):
    """Phase-shifted rotated coordinates scaled so that one period is 2 units."""
    period = _col(rng.uniform(max(32, 3 * token), 56, n))
    u, v, _ = _frame(rng, n, 0, 0, max_angle)
    phase = _col(rng.uniform(0, 2, n))
    return u * 2 / period + phase, v * 2 / period + phase, period


def _stripes(rng, n, token):
    u, _, period = _waves(rng, n, np.pi / 2, token)
    # distance to the nearest stripe edge, in pixels, signed by the square wave
    return _fill(-np.sin(np.pi * u) * period / (2 * np.pi))


def _checkerboard(rng, n, token):
    u, v, period = _waves(rng, n, np.pi / 12, token)
    return _fill(-np.sin(np.pi * u) * np.sin(np.pi * v) * period / np.pi)


def _blob(rng, n, token):
    u, v, r = _frame(rng, n, max(20, 1.5 * token), 40, np.pi)
    stretch = _col(rng.uniform(1.0, 1.8, n))
    return np.exp(-0.5 * ((u / stretch) ** 2 + (v * stretch) ** 2) / (r / 1.5) ** 2)


_DRAW = [_circle, _square, _triangle, _stripes, _checkerboard, _ring, _cross, _blob]
assert len(_DRAW) == len(CLASS_NAMES)


# Colours are complementary corners of the RGB cube (black/white, red/cyan, green/magenta,
# blue/yellow, either way round).
LOW, HIGH = 0.1, 0.9


COLOUR_NAMES = {(0, 0, 0): "black", (0, 0, 1): "blue", (0, 1, 0): "green", (0, 1, 1): "cyan", (1, 0, 0): "red",
                (1, 0, 1): "magenta", (1, 1, 0): "yellow", (1, 1, 1): "white"}  # RGB corner -> name


def _colour_bits(rng, n):
    """The background's RGB corner per image (the foreground is the opposite corner)."""
    return rng.integers(0, 2, (n, 3)).astype(np.float32)


def caption(label: int, background_bits) -> str:
    """What an image shows, in words: "a red ring on a cyan background"."""
    bg = tuple(int(b) for b in background_bits)
    fg = tuple(1 - b for b in bg)
    return f"a {COLOUR_NAMES[fg]} {CLASS_NAMES[label]} on a {COLOUR_NAMES[bg]} background"


TEXTURE_LEVELS = 20  # the texture's largest excursion in 8-bit levels: shapes and palettes stay unmistakable
TEXTURE = TEXTURE_LEVELS / 255
GRAIN_SCALES = (0.7, 1.5)  # pixels: the correlation length of the grain, drawn per image (within a token)
BLOTCH_SCALES = (3.0, 8.0)  # pixels: that of the blotches, which span tokens: neighbouring codes depend on
# each other the way a photograph's do, which a small drafter predicts far less well than the GPT
SHADING = 8 / 255  # the largest excursion of the soft shading across the image


def _smoothed_noise(rng, n: int, scales) -> np.ndarray:
    """[n, SIZE, SIZE] unit-variance Gaussian noise smoothed by a Gaussian of a width drawn per image from
    ``scales`` (pixels)."""
    scale = _col(rng.uniform(*scales, n))
    fy, fx = np.meshgrid(np.fft.fftfreq(SIZE), np.fft.fftfreq(SIZE), indexing="ij")
    smoothing = np.exp(-2 * np.pi ** 2 * scale ** 2 * (fx ** 2 + fy ** 2)[None])
    noise = np.fft.ifft2(np.fft.fft2(rng.standard_normal((n, SIZE, SIZE))) * smoothing).real
    return noise / noise.std(axis=(1, 2), keepdims=True)


def texture_field(rng, n: int, amplitude: float) -> np.ndarray:
    """[n, SIZE, SIZE] luminance offsets within +-``amplitude``: fine grain (``GRAIN_SCALES``) and blotches
    that span tokens (``BLOTCH_SCALES``) mixed in a proportion drawn per image, at a strength drawn per image,
    plus a soft linear shading in a random direction."""
    blotch_share = _col(rng.uniform(0.3, 0.8, n))  # of the noise's variance
    noise = (np.sqrt(1 - blotch_share) * _smoothed_noise(rng, n, GRAIN_SCALES)
             + np.sqrt(blotch_share) * _smoothed_noise(rng, n, BLOTCH_SCALES))
    strength = _col(rng.uniform(0.25, 0.5, n)) * amplitude  # the noise's standard deviation
    angle = rng.uniform(0, 2 * np.pi, n)
    ramp = (_col(np.cos(angle)) * (_X - SIZE / 2) + _col(np.sin(angle)) * (_Y - SIZE / 2)) / (SIZE / 2)
    shading = _col(rng.uniform(0, 1, n)) * min(SHADING, amplitude) * ramp
    return np.clip(noise * strength + shading, -amplitude, amplitude).astype(np.float32)


MAR_TOKEN = 16  # pixels per latent token of the MAR demo's KL autoencoder: its images are drawn for 16


def make_batch(rng: np.random.Generator, n: int, classes=None, token: int = 8, texture: float = 0.0):
    """``n`` images (uint8 [n, 128, 128, 3]) and their labels (int64 [n]); see ``make_captioned_batch``."""
    images, labels, _ = make_captioned_batch(rng, n, classes, token, texture=texture)
    return images, labels


def make_captioned_batch(rng: np.random.Generator, n: int, classes=None, token: int = 8, backgrounds=None,
                         texture: float = 0.0):
    """``n`` images (uint8 [n, 128, 128, 3]), their labels (int64 [n]) and captions (``caption``).

    ``token``: the pixels per token of the model the images are for. The smallest shapes, rings, arms and
    stripe periods grow with it so that every feature spans a token or more (8, the VQ's and the bundled
    models' data, is the default; the MAR demo's 16-pixel latents take 16).

    ``classes``: labels to draw (array of length ``n``); default uniform over ``CLASS_NAMES``.
    ``backgrounds``: background RGB corners ([n, 3] of 0/1) to draw instead of random ones.
    ``texture``: the texture's largest excursion (``TEXTURE`` for the textured demo; 0: flat colours)."""
    labels = rng.integers(0, len(CLASS_NAMES), n) if classes is None else np.asarray(classes, dtype=np.int64)
    mask = np.empty((n, SIZE, SIZE), np.float32)
    for k, draw in enumerate(_DRAW):
        idx = np.flatnonzero(labels == k)
        if len(idx):
            mask[idx] = draw(rng, len(idx), token)
    bits = _colour_bits(rng, n) if backgrounds is None else np.asarray(backgrounds, dtype=np.float32)
    bg, fg = LOW + (HIGH - LOW) * bits, LOW + (HIGH - LOW) * (1 - bits)
    img = bg[:, None, None] * (1 - mask[..., None]) + fg[:, None, None] * mask[..., None]
    if texture > 0:
        img = img + texture_field(rng, n, texture)[..., None]
    captions = [caption(int(label), b) for label, b in zip(labels, bits)]
    return (img * 255 + 0.5).clip(0, 255).astype(np.uint8), labels.astype(np.int64), captions


def balanced_labels(n: int) -> np.ndarray:
    """``n`` labels cycling through the classes (balanced evaluation sets)."""
    return np.arange(n) % len(CLASS_NAMES)
