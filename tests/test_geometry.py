"""The shape-fidelity measure: the data's own circles, squares and rings score near 1, flat or textured, and the
faults the demo's samples show (a lumpy circle, a broken ring, a square grown a bump) score clearly less."""
import numpy as np
import pytest

from fastar.commands.bench.demo_data import CLASS_NAMES, HIGH, LOW, TEXTURE, balanced_labels, make_batch
from fastar.commands.bench.geometry import FITTED, best_fit_iou, foreground, shape_fidelity

_Y, _X = np.mgrid[0:128, 0:128] + 0.5


def painted(mask: np.ndarray, background=(0, 0, 1)) -> np.ndarray:
    """A demo-palette image of ``mask``: the foreground the background's complementary corner."""
    bg = LOW + (HIGH - LOW) * np.array(background, float)
    image = np.where(mask[..., None], 1 - bg, bg)
    return (image * 255 + 0.5).astype(np.uint8)


@pytest.mark.parametrize("texture", [0.0, TEXTURE], ids=["flat", "textured"])
def test_the_datas_own_shapes_score_near_one(texture):
    images, labels = make_batch(np.random.default_rng(3), 48, balanced_labels(48), texture=texture)
    scores = shape_fidelity(images, labels)
    assert set(scores) == set(FITTED)
    assert min(scores.values()) > 0.97, scores


def test_the_foreground_is_read_through_the_palette_whatever_the_colours():
    disc = (_X - 60) ** 2 + (_Y - 70) ** 2 <= 30 ** 2
    for background in [(0, 0, 0), (1, 1, 1), (1, 0, 1), (0, 1, 1)]:
        assert np.array_equal(foreground(painted(disc, background)), disc)


def test_faults_score_clearly_less_than_true_shapes():
    disc = (_X - 64) ** 2 + (_Y - 64) ** 2 <= 30 ** 2
    ellipse = ((_X - 64) / 36) ** 2 + ((_Y - 64) / 24) ** 2 <= 1
    lumpy = disc | ((_X - 94) ** 2 + (_Y - 64) ** 2 <= 12 ** 2)
    d2 = (_X - 64) ** 2 + (_Y - 64) ** 2
    ring = (d2 <= 36 ** 2) & (d2 >= 26 ** 2)
    broken_ring = ring & ~((_X > 64) & (np.abs(_Y - 64) < 20))
    square = (np.abs(_X - 64) <= 28) & (np.abs(_Y - 64) <= 28)
    bumped = square | ((np.abs(_X - 96) <= 8) & (np.abs(_Y - 64) <= 10))

    assert best_fit_iou(disc, "circle") > 0.98 and best_fit_iou(ring, "ring") > 0.97
    assert best_fit_iou(square, "square") > 0.98
    assert best_fit_iou(ellipse, "circle") < 0.85
    assert best_fit_iou(lumpy, "circle") < 0.92
    assert best_fit_iou(broken_ring, "ring") < 0.85
    assert best_fit_iou(bumped, "square") < 0.93
    assert best_fit_iou(np.zeros_like(disc), "circle") == 0.0  # nothing drawn


def test_only_the_classes_present_are_scored():
    images, labels = make_batch(np.random.default_rng(0), 3, [CLASS_NAMES.index("ring")] * 3)
    assert list(shape_fidelity(images, labels)) == ["ring"]
