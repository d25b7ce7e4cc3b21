"""What the three benchmarks (decoders, MAR, DD) share: quality in the demo classifier's features against real
images, the Frechet distance to a baseline row, the latency note, and the two-panel quality plot."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ...errors import FastARError
from ...pipeline import outputs_to_images

CHUNK = 16  # rows per batched quality run
REAL_IMAGES = 512


def real_features(judge, token: int = 8):
    """The judge's features of ``REAL_IMAGES`` real demo images (one seed for every benchmark), drawn as the demo
    models of ``token``-pixel tokens learnt them: textured for the 8-pixel ones (class, text and DD demos), flat for
    the 16-pixel MAR and VAR demos."""
    from .classifier import classify
    from .demo_data import TEXTURE, make_batch

    images, _ = make_batch(np.random.default_rng(12345), REAL_IMAGES, token=token, texture=TEXTURE if token == 8 else 0.0)
    return classify(judge, images)[1]


def quality(models, judge, codes: torch.Tensor, labels: list[int], reference_feats) -> dict:
    from .classifier import classify, frechet_distance

    images = outputs_to_images(models.vq, models.ar, codes)
    preds, feats = classify(judge, images)
    accuracy = float((np.asarray(preds) == np.asarray(labels)).mean())
    return {"class_accuracy": accuracy, "frechet": frechet_distance(feats, reference_feats), "_feats": feats}


def frechet_against(results: dict, baseline: str) -> None:
    """Each row's Frechet distance to the ``baseline`` row's images (``frechet_vs_BASELINE``); the features the
    quality measure kept for it are dropped."""
    from .classifier import frechet_distance

    reference = results[baseline]["_feats"]
    for r in results.values():
        r[f"frechet_vs_{baseline}"] = frechet_distance(r.pop("_feats"), reference)


def latency_note(report: dict) -> str:
    return (f"Latency: batch 1, median of interleaved runs on {report['device']} ({report['machine']}), image "
            f"decode excluded. The benchmark took {report['bench_time_s'] / 60:.1f} min.")


def require_matplotlib() -> None:
    """Fail before the long run, not after it, when the plot cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise FastARError("the Pareto plot needs matplotlib, which FastAR does not install: pip install "
                          "matplotlib, or run the benchmark with --no-pareto") from None


def quality_panels():
    """A figure with two panels side by side (class accuracy, Frechet distance), drawn off screen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, 2, figsize=(12, 4.6))


LEGEND_CHARACTERS = 170


def save_panels(fig, axes, title: str, path: Path) -> None:
    """One legend under both panels (inside a panel it can hide a point: it hid plain AR's star), then save."""
    import matplotlib.pyplot as plt

    handles, labels = axes[0].get_legend_handles_labels()
    # as many columns as the longest label leaves room for (about 170 characters across at this size and font):
    # a long single row ran off both edges
    columns = max(1, min(len(labels), LEGEND_CHARACTERS // (max(map(len, labels)) + 6)))
    rows = -(-len(labels) // columns)
    fig.legend(handles, labels, loc="lower center", ncol=columns, fontsize=8, frameon=False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.045 * rows + 0.015, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
