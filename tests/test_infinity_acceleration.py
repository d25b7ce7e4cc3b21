"""FastVAR and SkipVAR on Infinity (InfinitySession.forward_pruned): the three sub-layers of each pruned block run on
the tokens the rule keeps, RoPE turned by those tokens' own positions, only their keys and values cached; the
conditional-only and skipped scales go through the sampler's loop. Proven bit for bit against the release in
tests/conformance/test_fastvar_infinity.py."""
from __future__ import annotations

import pytest
import torch

from fastar.samplers.decoders import decode_next_scale
from fastar.samplers.few_step_loops.scale_acceleration import FASTVAR, CachedTokenPruning, ScaleAcceleration
from fastar.samplers.processing import SamplingSettings
from tiny_infinity import captions, tiny_infinity, tiny_vae

GREEDY = SamplingSettings(cfg_scale=3.0, top_k=1)


def run(model, acceleration=None, sampling=GREEDY):
    codes = []
    f_hat, stats = decode_next_scale(model, captions(), sampling, seed=0, vqvae=tiny_vae(), acceleration=acceleration,
                                     scale_codes=codes)
    return f_hat, stats, codes


class Spy(CachedTokenPruning):
    """Records what every sub-layer was given, kept and restored."""

    def __init__(self, *args):
        super().__init__(*args)
        self.seen, self.restored = [], []

    def keep(self, block, name, x):
        kept = super().keep(block, name, x)
        self.seen.append((self.scale, block, name, x.shape, kept))
        return kept

    def restore(self, block, name, out, kept):
        self.restored.append((self.scale, block, name, out.shape, kept))
        return super().restore(block, name, out, kept)


def spied_run(model, acceleration, session=None):
    import fastar.samplers.few_step_loops.scale_acceleration as module

    sessions, spies, start = [], [], model.start
    model.start = lambda *a, **k: sessions.append(session or start(*a, **k)) or sessions[-1]
    original = module.CachedTokenPruning
    module.CachedTokenPruning = lambda *a: spies.append(Spy(*a)) or spies[-1]
    try:
        f_hat, stats, codes = run(model, acceleration)
    finally:
        module.CachedTokenPruning = original
        del model.start
    return f_hat, stats, codes, sessions[0], spies[0]


def test_nothing_pruned_skipped_or_replaced_gives_the_plain_image_through_the_pruned_path():
    model = tiny_infinity(depth=4)
    plain, _, plain_codes = run(model)
    same, stats, codes = run(model, ScaleAcceleration(prune_ratios=(0.0, 0.0)))
    assert torch.equal(plain, same) and all(torch.equal(a, b) for a, b in zip(plain_codes, codes))
    assert stats.transformer_work == 1.0


def test_every_sub_layer_of_the_release_blocks_prunes_and_only_the_kept_tokens_keys_are_cached():
    """Depth 32 as Infinity-2B: blocks 3..27 prune self-attention, cross-attention and FFN at the two scales before
    the two skipped ones (256 px: 6 x 6 and 8 x 8), each restoring what it kept; the 4 x 4 scale's outputs restore."""
    model = tiny_infinity(depth=32)
    _, stats, codes, session, spy = spied_run(model, FASTVAR)
    shapes = model.scale_shapes
    assert len(codes) == len(shapes) - 2 and spy.plan.cache_scale == 2
    for scale, block, name, shape, kept in spy.seen:
        n = shapes[scale][0] * shapes[scale][1]
        ratio = {3: 0.4, 4: 0.5}.get(scale, 0.0) if 3 <= block < 28 else 0.0
        assert (kept is None) == (ratio == 0.0), (scale, block, name)
        if kept is not None:
            assert kept.shape == (4, n - int(n * ratio)) and int(kept.max()) < n
    assert {name for *_, name, _, _ in spy.seen} == {"attn", "cross", "ffn"}
    for (_, _, _, _, kept), (_, _, _, out, given) in zip(spy.seen, spy.restored):
        assert given is kept and (kept is None or out[1] == kept.shape[1])  # each sub-layer ran on its kept tokens
    assert all(out.shape[1] == 16 for (_, name), out in spy.cached.items())
    ran = [sum(h * w for h, w in shapes[:5])] * 32
    for block in range(3, 28):
        ran[block] -= int(36 * 0.4) + int(64 * 0.5)
    assert [cache.filled for cache in session.caches] == ran
    assert stats.settings["scale_acceleration"]["pruned_blocks"] == [3, 28]


def test_a_kept_token_is_turned_by_its_own_position_and_attends_to_the_kept_keys_alone():
    """A pruning that keeps every token in reverse order gives the plain logits (RoPE follows the tokens; keys are
    attended as a set); one that keeps the first half caches those alone."""
    model = tiny_infinity(depth=2)

    class Keep(CachedTokenPruning):
        def __init__(self, plan, shapes, pick):
            super().__init__(plan, shapes)
            self.pick = pick

        def keep(self, block, name, x):
            super().keep(block, name, x)
            return self.pick(x)

        def restore(self, block, name, out, kept):  # the tokens left out take zeros
            h, w = self.hw(self.scale)
            return torch.zeros(out.shape[0], h * w, out.shape[2]).scatter(1, kept[..., None].expand_as(out), out)

    plan = ScaleAcceleration(prune_ratios=(0.0,)).plan(len(model.scale_shapes), 2)
    inputs = [None] + [torch.randn(2, h * w, model.cfg.bits, generator=torch.Generator().manual_seed(s))
                       for s, (h, w) in enumerate(model.scale_shapes[1:3])]
    plain, pruned = model.start(captions(), cfg=True), model.start(captions(), cfg=True)
    backwards = Keep(plan, model.scale_shapes, lambda x: torch.arange(x.shape[1] - 1, -1, -1).expand(x.shape[0], -1))
    for scale in range(3):
        a, b = plain.forward(scale, inputs[scale]), pruned.forward_pruned(scale, inputs[scale], backwards.at(scale))
        torch.testing.assert_close(b.cond, a.cond, rtol=1e-4, atol=1e-4)
    half = Keep(plan, model.scale_shapes, lambda x: torch.arange(max(1, x.shape[1] // 2)).expand(x.shape[0], -1))
    session = model.start(captions(), cfg=True)
    for scale in range(3):
        session.forward_pruned(scale, inputs[scale], half.at(scale))
    assert [c.filled for c in session.caches] == [1 + 2 + 8] * 2


def test_skipped_scales_never_run_and_conditional_only_scales_run_half_the_rows_unguided():
    model = tiny_infinity(depth=4)
    plain, _, plain_codes = run(model)
    f_hat, stats, codes = run(model, ScaleAcceleration(skip_last=2))
    assert len(codes) == len(plain_codes) - 2 and all(torch.equal(a, b) for a, b in zip(codes, plain_codes))
    assert stats.recomputed_share[-2:] == [0.0, 0.0] and not torch.equal(f_hat, plain)
    _, stats, codes, _, spy = spied_run(model, ScaleAcceleration(uncond_last=2))
    assert all(torch.equal(a, b) for a, b in zip(codes[:-2], plain_codes[:-2]))
    assert {shape[0] for scale, *_, shape, _ in [(s, b, n, sh, k) for s, b, n, sh, k in spy.seen] if scale >= 5} == {2}
    assert {shape[0] for scale, _, _, shape, _ in spy.seen if scale < 5} == {4}
    assert stats.recomputed_share[-2:] == [0.5, 0.5]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_on_the_cpu(dtype):
    f_hat, _, codes = run(tiny_infinity(depth=8).to(dtype), FASTVAR)
    assert torch.isfinite(f_hat).all() and all(((c == 0) | (c == 1)).all() for c in codes)
