"""Builds the FastVAR conformance fixture with the official pruning functions (run by hand, never by the tests).

    git -C MIRROR_OF_csguoh/FastVAR archive HEAD | tar -x -C CHECKOUT
    python tests/conformance/build/fastvar.py --official CHECKOUT [--commit SHA] [--out tests/conformance/fixtures]

``fastvar/``: the official ``Infinity/infinity/models/fastvar_utils.py`` (pure torch) imported from the checkout and
run on fixed random inputs, saved in ``cases.safetensors``: for each case a sub-layer input ``x`` ``[2, h*w, C]`` of
a pruned scale, the indices ``compute_merge``'s ``get_src_tgt_idx`` keeps, a sub-layer output for those tokens, a
cached output of the 24 x 24 scale and what the official ``unmerge`` restores from them. ``expected.json`` records,
for every width of Infinity's 1:1 schedule and every one of Infinity-2B's 32 layers, how many tokens the official
``compute_merge`` lets through (the schedule FastAR maps from), and the layers and widths the official
``fastvar_basic.py`` / ``infinity.py`` prune, cache and skip, read from their source (they import flash-attn).
"""
from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from common import FIXTURES  # noqa: E402
from provenance import commit_of, packages, write_expected  # noqa: E402

UTILS = "Infinity/infinity/models/fastvar_utils.py"
BASIC = "Infinity/infinity/models/fastvar_basic.py"
INFINITY = "Infinity/infinity/models/infinity.py"
WIDTHS = (1, 2, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64)  # Infinity's 1:1 schedule at 1024 px (its comment's)
DEPTH = 32  # Infinity-2B
CACHE_HW = (24, 24)
CHANNELS = 4  # small: the rule is per token, the width only adds bytes


def official_utils(checkout: Path):
    spec = importlib.util.spec_from_file_location("fastvar_utils", checkout / UTILS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cases(utils, generator: torch.Generator) -> dict:
    tensors = {}
    for width in (32, 40):
        shape = (1, width, width)
        x = torch.randn(2, width * width, CHANNELS, generator=generator)
        merge, unmerge, kept_of = utils.compute_merge(x, is_later_layer=True, x_shape=shape)
        kept = kept_of()[..., 0]
        out = torch.randn(2, kept.shape[1], CHANNELS, generator=generator)
        cached = torch.randn(2, CACHE_HW[0] * CACHE_HW[1], CHANNELS, generator=generator)
        assert torch.equal(merge(x), x.gather(1, kept[..., None].expand(-1, -1, CHANNELS)))
        tensors |= {f"x_{width}": x, f"kept_{width}": kept.contiguous(), f"out_{width}": out,
                    f"cached_{width}": cached, f"restored_{width}": unmerge(out, cached.clone(), list(CACHE_HW))}
    return tensors


def kept_counts(utils) -> list:
    """``[scale][layer]``: the tokens the official compute_merge lets through (its merge's output length)."""
    later = later_layers()
    counts = []
    for width in WIDTHS:
        x = torch.zeros(1, width * width, 1)
        counts.append([utils.compute_merge(x, is_later_layer=layer in later, x_shape=(1, width, width))[0](x).shape[1]
                       for layer in range(DEPTH)])
    return counts


def later_layers(source: str | None = None) -> list:
    source = source if source is not None else SOURCES[BASIC]
    found = re.search(r"layer_idx in list\(range\((\d+)\s*,\s*(\d+)\)\)", source)
    return list(range(int(found[1]), int(found[2])))


SOURCES: dict = {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--official", type=Path, required=True, help="a checkout of csguoh/FastVAR")
    parser.add_argument("--commit", help="its commit, where the checkout is no git work tree")
    parser.add_argument("--out", type=Path, default=FIXTURES)
    args = parser.parse_args()
    for path in (BASIC, INFINITY):
        SOURCES[path] = (args.official / path).read_text()
    utils = official_utils(args.official)
    folder = args.out / "fastvar"
    folder.mkdir(parents=True, exist_ok=True)
    save_file(cases(utils, torch.Generator().manual_seed(0)), folder / "cases.safetensors")
    cached = re.search(r"self\.cached_size = \[(\d+), (\d+)\]", SOURCES[BASIC])
    skipped = re.search(r"if (\d+) == pn\[2\] or (\d+) == pn\[2\]:\s*\n\s*continue", SOURCES[INFINITY])
    source = {"repository": "csguoh/FastVAR", "commit": args.commit or commit_of(args.official),
              "packages": packages("torch"), "builder": "tests/conformance/build/fastvar.py",
              "made_with": f"{UTILS}: compute_merge, masked_previous_scale_cache; {BASIC}: the pruned layers and "
                           f"the cached size; {INFINITY}: the skipped widths"}
    schedule = {"widths": list(WIDTHS), "depth": DEPTH, "kept_tokens": kept_counts(utils),
                "pruned_layers": later_layers(), "cached_width": int(cached[2]),
                "skipped_widths": [int(skipped[1]), int(skipped[2])], "cache_hw": list(CACHE_HW)}
    write_expected(folder, source, [{"name": "infinity 1:1 schedule", **schedule}])


if __name__ == "__main__":
    main()
