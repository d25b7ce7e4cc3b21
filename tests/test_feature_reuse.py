"""LazyMAR-style feature reuse for MAR's sampler: the cache gives the plain vectors back where nothing moved, the
fixed tokens reach it, the schedule and the work count say what runs, and on the demo MAR the samples keep
their class."""
import pytest
import torch

from fastar.errors import FastARError
from fastar.model_loaders import load_ar_model
from fastar.model_loaders.mar.lazy import LazyFeatures, prune_block
from fastar.model_loaders.shared.demo import DEMO_MAR
from fastar.model_loaders.mar.model import MAR, MARConfig, Trace
from fastar.model_loaders.shared.protocol import ClassConditioning
from fastar.samplers.masked_loops.feature_reuse import FeatureReuse
from fastar.samplers.masked_loops.masked import MaskedSettings, Plan, masked_decode

ROWS = ClassConditioning(torch.tensor([1, 3]))


def deep_mar(seed=0, dtype=torch.float32, scale=0.2, encoder_depth=2):
    """Deep enough that pruning happens inside the decoder (after block 1 of 6)."""
    torch.manual_seed(seed)
    cfg = MARConfig(dim=32, encoder_depth=encoder_depth, encoder_heads=2, decoder_dim=32, decoder_depth=6, decoder_heads=2,
                    head_width=32, head_depth=2, token_dim=4, grid=(4, 4), buffer=2, num_classes=4)
    model = MAR(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, scale)
    model.to(dtype).diffloss.float()  # as the loader keeps it: the head in fp32
    return model


def context(model, known_count, seed=0):
    """Tokens ``[2, L, C]`` of which the first ``known_count`` of a random order are known."""
    gen = torch.Generator().manual_seed(seed)
    L = model.cfg.num_tokens
    order = torch.stack([torch.randperm(L, generator=gen) for _ in range(2)])
    tokens = torch.randn(2, L, model.cfg.token_dim, generator=gen)
    known = torch.zeros(2, L, dtype=torch.bool).scatter_(1, order[:, :known_count], True)
    return tokens, known, order


def plain(model, tokens, known, count):
    cond, uncond = (model.class_vectors(ROWS, uncond=flag) for flag in (False, True))
    return (model.conditions(tokens, known, cond, count), model.conditions(tokens, known, uncond, count))


def at(z, positions):
    return z[torch.arange(2)[:, None], positions]


def test_prune_block_follows_the_reference_depths():
    assert [prune_block(d) for d in (1, 3, 6, 12, 16, 20)] == [0, 1, 1, 2, 3, 4]


@pytest.mark.parametrize("keep", [16 + 2, 6])  # every slot, or the needed ones and a few
def test_reuse_right_after_a_refresh_with_nothing_new_gives_the_plain_vectors(keep):
    model = deep_mar()
    tokens, known, order = context(model, 7)
    cond, uncond = (model.class_vectors(ROWS, uncond=flag) for flag in (False, True))
    lazy = LazyFeatures(model)
    with torch.no_grad():
        z_cond, z_uncond = lazy.refresh(tokens, known, cond, uncond, 7)
        expected = plain(model, tokens, known, 7)
        assert torch.allclose(z_cond, expected[0], atol=1e-5) and torch.allclose(z_uncond, expected[1], atol=1e-5)
        needed = order[:, 7:10]
        reused = lazy.reuse(tokens, cond, order[:, :0], needed, keep)
    for got, want in zip(reused, expected):
        assert torch.allclose(at(got, needed), at(want, needed), atol=1e-5)


def test_the_tokens_fixed_since_the_refresh_reach_the_reused_vectors():
    model = deep_mar()
    tokens, known, order = context(model, 6)
    cond, uncond = (model.class_vectors(ROWS, uncond=flag) for flag in (False, True))
    fresh, needed = order[:, 6:9], order[:, 9:12]
    now_known = known.clone().scatter_(1, fresh, True)
    expected = plain(model, tokens, now_known, 9)
    errors = []
    with torch.no_grad():
        for told in (fresh, fresh[:, :0]):  # the fixed tokens given to the cache, or not
            lazy = LazyFeatures(model)
            lazy.refresh(tokens, known, cond, uncond, 6)
            z_cond, _ = lazy.reuse(tokens, cond, told, needed, 18)
            errors.append((at(z_cond, needed) - at(expected[0], needed)).norm())
    assert errors[0] < 0.6 * errors[1], errors  # stale features cost something, but far less than ignoring the news


def test_the_fixed_tokens_are_encoded_as_plain_mar_would_with_one_encoder_block():
    # one block: every known token's keys and values depend on its input alone, so the cache holds exactly what
    # a plain call computes, and the buffer and the fresh tokens (the only ones a reusing step encodes) come
    # out as plain MAR's; the older tokens' encodings are the stale ones (they never see the fresh tokens)
    model = deep_mar(encoder_depth=1)
    tokens, known, order = context(model, 6)
    cond = model.class_vectors(ROWS, uncond=False)
    fresh = order[:, 6:9]
    trace = Trace()
    with torch.no_grad():
        model.conditions(tokens, known.clone().scatter_(1, fresh, True), cond, 9, trace)
        lazy = LazyFeatures(model)
        lazy.refresh(tokens, known, cond, None, 6)
        lazy.reuse(tokens, cond, fresh, order[:, 9:11], 18)
    slots = torch.cat([torch.arange(2).expand(2, -1), fresh + 2], dim=1)
    assert torch.allclose(at(lazy.decoder_input, slots), at(trace.decoder_input, slots), atol=1e-5)
    older = order[:, :6] + 2
    assert not torch.allclose(at(lazy.decoder_input, older), at(trace.decoder_input, older), atol=1e-3)


def test_pruned_slots_skip_the_later_blocks_but_the_needed_ones_never_do():
    model = deep_mar()
    tokens, known, order = context(model, 6)
    cond, uncond = (model.class_vectors(ROWS, uncond=flag) for flag in (False, True))
    fresh, needed = order[:, 6:8], order[:, 8:10]
    results = []
    with torch.no_grad():
        for keep in (18, 4):
            lazy = LazyFeatures(model)
            lazy.refresh(tokens, known, cond, uncond, 6)
            results.append(lazy.reuse(tokens, cond, fresh, needed, keep)[0])
    everything, pruned = results
    assert torch.isfinite(at(pruned, needed)).all() and at(pruned, needed).abs().sum() > 0
    assert not torch.allclose(at(pruned, needed), at(everything, needed), atol=1e-6)  # the others' keys are stale
    assert torch.allclose(at(pruned, needed), at(everything, needed), atol=0.5)


def test_the_schedule_refreshes_as_told_and_keeps_what_is_needed():
    reuse = FeatureReuse(start_percent=0.25, end_percent=0.75, refresh_every=3)
    assert list(reuse.full_steps(8)) == [True, True, True, False, False, True, True, True]
    assert list(FeatureReuse(start_percent=0.0, refresh_every=2).full_steps(5)) == [True, False, True, False, True]
    assert FeatureReuse(token_reuse=0.75).keep(80, 10) == 10 + 18 and FeatureReuse(token_reuse=0.0).keep(80, 10) == 80
    for bad in (dict(start_percent=0.5, end_percent=0.5), dict(end_percent=1.5), dict(refresh_every=1),
                dict(token_reuse=1.0), dict(token_reuse=-0.1)):
        with pytest.raises(FastARError):
            FeatureReuse(**bad).validate()


def decode(model, reuse, cfg_scale=2.0, seed=0):
    settings = MaskedSettings(num_iter=8, cfg_scale=cfg_scale, diffusion_steps=4, reuse=reuse)
    return masked_decode(model, ROWS, settings, generator=torch.Generator().manual_seed(seed))


def test_without_a_reusing_step_the_sampler_is_plain_mar():
    model = deep_mar()
    plain_tokens, plain_stats = decode(model, None)
    tokens, stats = decode(model, FeatureReuse(start_percent=0.99, head_refresh_every=0))  # every step in full
    assert torch.equal(tokens, plain_tokens) and plain_stats.transformer_work is None
    assert stats.recomputed_share == [1.0] * 8 and stats.transformer_work == 1.0


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_reusing_steps_do_less_work_and_say_how_much(cfg_scale):
    model = deep_mar()
    plain_tokens, _ = decode(model, None, cfg_scale)
    tokens, stats = decode(model, FeatureReuse(start_percent=0.25, refresh_every=3, token_reuse=0.8, head_refresh_every=0),
                           cfg_scale)
    full = FeatureReuse(start_percent=0.25, refresh_every=3).full_steps(8)
    assert [share == 1.0 for share in stats.recomputed_share] == list(full)
    assert all(0 < share < (0.5 if cfg_scale > 1 else 1.0) for share, f in zip(stats.recomputed_share, full) if not f)
    assert stats.transformer_work < 0.8
    assert torch.isfinite(tokens).all() and not torch.equal(tokens, plain_tokens)
    # the full steps before the first reused one are plain MAR's: the tokens they fixed agree
    plan = Plan.draw(model, MaskedSettings(num_iter=8, diffusion_steps=4), 2, torch.Generator().manual_seed(0))
    first = plan.order[:, plan.masked[3]:]
    assert torch.allclose(at(tokens, first), at(plain_tokens, first), atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reuse_runs_in_half_precision(dtype):
    model = deep_mar(dtype=dtype, scale=0.05)  # weights that plain MAR runs in fp16 without overflowing
    tokens, stats = decode(model, FeatureReuse(start_percent=0.25, refresh_every=3))
    reference, _ = decode(deep_mar(scale=0.05), FeatureReuse(start_percent=0.25, refresh_every=3))
    assert torch.isfinite(tokens).all() and stats.transformer_work < 1.0
    assert torch.allclose(tokens, reference, atol=0.05 * reference.abs().max())


@pytest.mark.parametrize("cfg_scale", [1.0, 2.5])
def test_a_reusing_head_call_at_the_full_calls_inputs_gives_its_eps(cfg_scale):
    from fastar.model_loaders.mar.model import HeadCache

    head = deep_mar().head
    gen = torch.Generator().manual_seed(1)
    x, z = torch.randn(3, 4, generator=gen), torch.randn(6 if cfg_scale > 1 else 3, 32, generator=gen)
    y = head.cond_embed(z) + head.time_embed(torch.tensor([300]))
    kept = HeadCache()
    with torch.no_grad():
        full = head.guided(x, y, cfg_scale, kept)
        reused = head.guided_reusing(x, y[:3], cfg_scale, kept)
        elsewhere = head.guided_reusing(x + 0.5, y[:3], cfg_scale, kept)
        moved = head.guided(x + 0.5, y, cfg_scale)
    assert len(kept.mlp) == 2 and (kept.guidance is None) == (cfg_scale == 1.0)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(full, reused))
    assert not torch.allclose(elsewhere[0], moved[0], atol=1e-4)  # another x_t: the kept MLP outputs are stale


def test_the_head_refreshes_as_told():
    model = load_ar_model(DEMO_MAR)  # trained: its eps matter (a random head's vanish under x_t's blow-up)
    runs = {every: decode(model, FeatureReuse(start_percent=0.99, head_refresh_every=every))[0] for every in (0, 2, 3)}
    plain, _ = decode(model, None)
    assert torch.equal(runs[0], plain)  # no head reuse and every MAR step in full: plain MAR
    different = (runs[2] - plain).norm() / plain.norm()
    assert 1e-3 < different < 0.5 and not torch.allclose(runs[2], runs[3], rtol=1e-3)
    with pytest.raises(FastARError, match="head refresh every 1"):
        FeatureReuse(head_refresh_every=1).validate()


def cspd_run(target, draft, reuse, verify, seed=0):
    from fastar.samplers.masked_loops.cspd import CSpDSettings, cspd_decode

    settings = MaskedSettings(num_iter=8, cfg_scale=2.0, diffusion_steps=4, reuse=reuse)
    return cspd_decode(target, draft, ROWS, settings, CSpDSettings(gamma=3, prefill=0.1, verify=verify),
                       generator=torch.Generator().manual_seed(seed))


def cspd_pair(dtype=torch.float32):
    return deep_mar(0, dtype, scale=0.05), deep_mar(1, dtype, scale=0.05)


@pytest.mark.parametrize("verify", ["steps", "merged"])
def test_cspd_with_every_call_in_full_is_plain_cspd(verify):
    target, draft = cspd_pair()
    plain, plain_stats = cspd_run(target, draft, None, verify)
    tokens, stats = cspd_run(target, draft, FeatureReuse(start_percent=0.99, head_refresh_every=0), verify)
    assert torch.equal(tokens, plain) and plain_stats.decoder == "cspd" and stats.decoder == "cspd+reuse"
    assert stats.transformer_work == 1.0 and set(stats.recomputed_share) == {1.0}


@pytest.mark.parametrize("verify, dtype", [("steps", torch.float32), ("merged", torch.float32),
                                           ("merged", torch.bfloat16), ("steps", torch.float16)])
def test_cspd_reuses_a_cache_only_for_the_context_it_holds(verify, dtype, monkeypatch):
    """Every reusing call (the draft inside a round; the target in merged mode) sees the context its cache's last
    call saw plus exactly the ``fresh`` positions: a dropped or replaced draft, or a token fixed without telling
    the cache, would break it. Steps mode's target calls stay full; the work says so."""
    from fastar.samplers.masked_loops.masked import Guide

    calls = []
    original = Guide.step_conditions

    def recording(self, tokens, known, known_count, needed, fresh, full):
        calls.append((self, tokens.clone(), known.clone(), fresh, full or fresh is None))
        return original(self, tokens, known, known_count, needed, fresh, full)

    monkeypatch.setattr(Guide, "step_conditions", recording)
    target, draft = cspd_pair(dtype)
    tokens, stats = cspd_run(target, draft, FeatureReuse(start_percent=0.0, refresh_every=8, token_reuse=0.5), verify)
    reused = {"target": 0, "draft": 0}
    for guide in {id(c[0]): c[0] for c in calls}.values():
        mine = [c for c in calls if c[0] is guide]
        name = "target" if guide.model is target else "draft"
        for (_, tokens_before, known_before, _, _), (_, tokens_now, known_now, fresh, full) in zip(mine, mine[1:]):
            if full:
                continue
            reused[name] += 1
            told = known_before.clone().scatter_(1, fresh, True)
            assert torch.equal(known_now, told)
            assert torch.equal(tokens_now[known_before], tokens_before[known_before])
    assert reused["draft"] > 0 and (reused["target"] > 0) == (verify == "merged")
    assert torch.isfinite(tokens).all() and stats.decoder == "cspd+reuse" and stats.transformer_work < 1.0
    assert len(stats.recomputed_share) == stats.drafter_forwards + stats.target_forwards
