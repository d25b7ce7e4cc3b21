"""Infinity's scale schedules: the (h, w) token grid of every scale, per aspect template and image size.

The release keeps a table of grids for eight height/width templates (1, 1.25, 1.333, 1.5, 1.75, 2, 2.5, 3), each
also mirrored (width/height, its key cut to three decimals: 0.8, 0.75, 0.666, ...). A schedule is the table's first
7 grids at 256 px (its "0.06M"), 10 at 512 px ("0.25M"), 12 at 768 px ("0.60M": in the table, not among
run_infinity.py's --pn choices) and 13 at 1024 px ("1M"); every grid is 16 px per token
(the 8B's VAE works at twice the grid, in 8 px patches that the transformer folds 2 x 2). Schedules of one template
are prefixes of each other, so a scale's tokens sit at the same place in every size's sequence, and RoPE is measured
against the 1M schedule's last grid. A ratio takes the nearest template (the release's argmin, first listed wins a
tie); FastAR refuses one that is far from every template rather than distort it.
"""
from __future__ import annotations

from ...errors import FastARError
from ..shared.building import parse_ratio

# (h, w) per scale for h/w >= 1, as the release lists them (dynamic_resolution.py)
PORTRAIT_GRIDS = {
    1.000: [(1, 1), (2, 2), (4, 4), (6, 6), (8, 8), (12, 12), (16, 16), (20, 20), (24, 24), (32, 32), (40, 40),
            (48, 48), (64, 64)],
    1.250: [(1, 1), (2, 2), (3, 3), (5, 4), (10, 8), (15, 12), (20, 16), (25, 20), (30, 24), (35, 28), (45, 36),
            (55, 44), (70, 56)],
    1.333: [(1, 1), (2, 2), (4, 3), (8, 6), (12, 9), (16, 12), (20, 15), (24, 18), (28, 21), (36, 27), (48, 36),
            (60, 45), (72, 54)],
    1.500: [(1, 1), (2, 2), (3, 2), (6, 4), (9, 6), (15, 10), (21, 14), (27, 18), (33, 22), (39, 26), (48, 32),
            (63, 42), (78, 52)],
    1.750: [(1, 1), (2, 2), (3, 3), (7, 4), (11, 6), (14, 8), (21, 12), (28, 16), (35, 20), (42, 24), (56, 32),
            (70, 40), (84, 48)],
    2.000: [(1, 1), (2, 2), (4, 2), (6, 3), (10, 5), (16, 8), (22, 11), (30, 15), (38, 19), (46, 23), (60, 30),
            (74, 37), (90, 45)],
    2.500: [(1, 1), (2, 2), (5, 2), (10, 4), (15, 6), (20, 8), (25, 10), (30, 12), (40, 16), (50, 20), (65, 26),
            (80, 32), (100, 40)],
    3.000: [(1, 1), (2, 2), (6, 2), (9, 3), (15, 5), (21, 7), (27, 9), (36, 12), (45, 15), (54, 18), (72, 24),
            (90, 30), (111, 37)],
}
SCALES_AT = {256: 7, 512: 10, 768: 12, 1024: 13}  # image size (px) -> scales: the release's 0.06M ... 1M
PIXELS_PER_TOKEN = 16
FAR = 1.15  # a ratio more than 15% off its nearest template is refused


def mirrored_key(ratio: float) -> float:
    """The release's key of a mirrored template: 1/ratio cut (not rounded) to three decimals."""
    return int(1 / ratio * 1000) / 1000


def templates() -> dict[float, list[tuple[int, int]]]:
    """Every template's full (1M) grid list, keyed by h/w, in the release's order (which breaks ties)."""
    table = {}
    for ratio, grids in PORTRAIT_GRIDS.items():
        table[ratio] = grids
        if ratio != 1.0:
            table[mirrored_key(ratio)] = [(w, h) for h, w in grids]
    return table


TEMPLATES = templates()


def ratio_name(grids: list[tuple[int, int]]) -> str:
    """A template as users give ratios: "W:H" of its last grid, reduced."""
    from math import gcd

    h, w = grids[-1]
    common = gcd(h, w)
    return f"{w // common}:{h // common}"


def template_of(aspect_ratio: str | None) -> float:
    """The template (h/w key) of a "W:H" ratio: the nearest, as the release picks it."""
    width, height = parse_ratio(aspect_ratio)
    wanted = height / width
    key = min(TEMPLATES, key=lambda t: abs(t - wanted))  # min keeps the first of equals, as the release's argmin
    if max(key / wanted, wanted / key) > FAR:
        offered = ", ".join(ratio_name(g) for g in TEMPLATES.values())
        raise FastARError(f"aspect ratio {aspect_ratio}: Infinity draws the ratios of its templates ({offered}); "
                          f"{aspect_ratio} is far from all of them: pick one of those")
    return key


def scale_schedule(image_size: int | None, aspect_ratio: str | None) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """(each scale's (h, w), the grid RoPE positions are measured against: the 1M schedule's last) for an image
    size (default 1024) and a "W:H" ratio (default 1:1)."""
    size = 1024 if image_size is None else image_size
    if size not in SCALES_AT:
        raise FastARError(f"image size {size}: Infinity draws {', '.join(map(str, SCALES_AT))} px images (its "
                          "0.06M, 0.25M, 0.60M and 1M schedules); pick one of those")
    grids = TEMPLATES[template_of(aspect_ratio)]
    return grids[: SCALES_AT[size]], grids[-1]
