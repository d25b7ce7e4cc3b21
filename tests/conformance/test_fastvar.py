"""FastVAR's cached token pruning against the official functions (csguoh/FastVAR's fastvar_utils.py, run by
build/fastvar.py): the tokens FastAR keeps and what it restores equal the official ones exactly, and FastAR's
default schedule, mapped onto Infinity's 13 scales and 32 layers, lets through exactly the tokens the official
code does at every scale and layer, caches the same scale and skips the same two."""
from __future__ import annotations

import torch
from safetensors.torch import load_file

from fastar.samplers.few_step_loops.scale_acceleration import (FASTVAR, CachedTokenPruning, pivotal_tokens,
                                                               restore_tokens)
from fastar.tests.conformance.common import expected, fixture

CASE = "fastvar"


def schedule() -> dict:
    return expected(CASE)["runs"][0]


def test_kept_tokens_and_restored_outputs_equal_the_official_functions():
    cases, cache_hw = load_file(fixture(CASE) / "cases.safetensors"), tuple(schedule()["cache_hw"])
    for width, ratio in ((32, 0.4), (40, 0.5)):
        x, official = cases[f"x_{width}"], cases[f"kept_{width}"]
        n = x.shape[1]
        kept = pivotal_tokens(x, n - int(n * ratio))
        assert torch.equal(kept, official), f"width {width}: FastAR keeps other tokens than the official code"
        restored = restore_tokens(cases[f"out_{width}"], official, cases[f"cached_{width}"], cache_hw, (width, width))
        assert torch.equal(restored, cases[f"restored_{width}"]), f"width {width}: restored outputs differ"


def test_default_schedule_on_infinitys_scales_lets_through_the_official_token_counts():
    expect = schedule()
    widths, depth = expect["widths"], expect["depth"]
    plan = FASTVAR.plan(len(widths), depth)
    assert [widths[s] for s in range(plan.runs, len(widths))] == expect["skipped_widths"]
    assert widths[plan.cache_scale] == expect["cached_width"]
    assert list(plan.blocks) == expect["pruned_layers"]
    pruning = CachedTokenPruning(plan, [(w, w) for w in widths])
    for scale in range(plan.runs):
        pruning.at(scale)
        x = torch.randn(1, widths[scale] ** 2, 2)
        counts = []
        for layer in range(depth):
            kept = pruning.keep(layer, "attn", x)
            counts.append(x.shape[1] if kept is None else kept.shape[1])
        assert counts == expect["kept_tokens"][scale], f"width {widths[scale]}"
