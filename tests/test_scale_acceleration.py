"""FastVAR's cached token pruning and SkipVAR's step skipping and unconditional-branch replacement on VAR's sampler
(samplers/few_step_loops/scale_acceleration.py, VARSession.forward_pruned). The pruning rule itself is proven
against the official functions in tests/conformance/test_fastvar.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastar.errors import FastARError
from fastar.model_loaders.shared.protocol import ClassConditioning
from fastar.model_loaders.var.model import layer_norm
from fastar.samplers.decoders import decode_next_scale
from fastar.samplers.few_step_loops.scale_acceleration import (FASTVAR, CachedTokenPruning, ScaleAcceleration,
                                                               pruned_blocks, restore_tokens)
from fastar.samplers.processing import SamplingSettings
from tiny_var import tiny_var, tiny_vqvae

ROWS = ClassConditioning(torch.tensor([1, 3]))
SAMPLING = SamplingSettings(cfg_scale=1.5, top_k=8)


def run(acceleration=None, model=None, sampling=SAMPLING, seed=0, codes=None):
    return decode_next_scale(model or tiny_var(), ROWS, sampling, seed=seed, vqvae=tiny_vqvae(),
                             acceleration=acceleration, scale_codes=codes)


class Spy(CachedTokenPruning):
    """Records every sub-layer's input and kept tokens, per scale."""

    def __init__(self, *args):
        super().__init__(*args)
        self.seen = []

    def keep(self, block, name, x):
        kept = super().keep(block, name, x)
        self.seen.append((self.scale, block, name, x, kept))
        return kept


def spied_run(acceleration, model):
    """A decode whose session and pruning are kept for inspection."""
    import fastar.samplers.few_step_loops.scale_acceleration as module

    sessions, spies, start = [], [], model.start
    model.start = lambda *a, **k: sessions.append(start(*a, **k)) or sessions[-1]
    original = module.CachedTokenPruning
    module.CachedTokenPruning = lambda *a: spies.append(Spy(*a)) or spies[-1]
    try:
        f_hat, stats = run(acceleration, model)
    finally:
        module.CachedTokenPruning = original
    return f_hat, stats, sessions[0], spies[0]


def test_nothing_pruned_skipped_or_replaced_gives_the_plain_samplers_image_through_the_pruned_path():
    plain, _ = run()
    same, stats = run(ScaleAcceleration(prune_ratios=(0.0, 0.0)))
    assert torch.equal(plain, same)
    assert stats.transformer_work == 1.0 and stats.recomputed_share == [1.0] * 4


def test_pruned_scale_runs_the_most_deviating_tokens_and_caches_only_their_keys():
    """Ratio 0.5 at the last scale (16 tokens): each sub-layer of each block keeps the 8 tokens of its own input
    farthest from the mean; the cache grows by exactly those tokens' keys, computed from their inputs."""
    model = tiny_var()
    _, stats, session, spy = spied_run(ScaleAcceleration(prune_ratios=(0.5,)), model)
    last = [s for s in spy.seen if s[0] == 3]
    assert len(last) == 2 * len(model.blocks) and all(kept.shape == (4, 8) for *_, kept in last)
    for _, block, name, x, kept in last:
        deviation = (x - x.mean(1, keepdim=True)).square().sum(-1)
        threshold = deviation.sort(1, descending=True).values[:, 7:8]
        assert (deviation.gather(1, kept) >= threshold).all() and kept.unique(dim=1).shape[1] == 8
    ffn_input = [x for s, b, name, x, _ in last if b == 0 and name == "ffn"][0]
    attn_input = [x for s, b, name, x, _ in last if b == 0 and name == "attn"][0]
    assert not torch.equal(ffn_input, attn_input)  # chosen afresh from the FFN's own input
    for index, (block, cache) in enumerate(zip(model.blocks, session.caches)):
        assert cache.filled == 1 + 4 + 9 + 8
        _, _, _, x, kept = [s for s in last if s[1] == index and s[2] == "attn"][0]
        cond = session.cond
        _, _, scale1, _, shift1, _ = block.ada_lin(cond).view(-1, 1, 6, x.shape[-1]).unbind(2)
        h = layer_norm(x.gather(1, kept[..., None].expand(-1, -1, x.shape[-1])), block.eps) * (1 + scale1) + shift1
        qkv = block.attn.mat_qkv(h)
        k = F.normalize(qkv.view(4, 8, 3, block.attn.heads, -1)[:, :, 1].transpose(1, 2), dim=-1)
        torch.testing.assert_close(cache.k[:, :, 14:22], k)
        assert not cache.k[:, :, 22:].any()
    assert stats.settings["scale_acceleration"]["forwarded_tokens"] == [1, 4, 9, 8]


def test_pruned_slots_take_the_cache_scales_output_area_interpolated():
    """6 x 6 cached, 8 x 8 now (not an integer factor): every slot not kept is the area average of the cached map."""
    g = torch.Generator().manual_seed(0)
    cached, out = torch.randn(2, 36, 3, generator=g), torch.randn(2, 5, 3, generator=g)
    kept = torch.stack([torch.randperm(64, generator=g)[:5] for _ in range(2)])
    restored = restore_tokens(out, kept, cached, (6, 6), (8, 8))
    area = F.adaptive_avg_pool2d(cached.view(2, 6, 6, 3).permute(0, 3, 1, 2), (8, 8)).permute(0, 2, 3, 1)
    expect = area.reshape(2, 64, 3).clone()
    for row in range(2):
        expect[row, kept[row]] = out[row]
    torch.testing.assert_close(restored, expect)


def test_restoration_reads_the_cache_scale_of_the_same_block_and_sub_layer():
    plan = ScaleAcceleration(prune_ratios=(0.5,)).plan(4, 2)
    pruning = CachedTokenPruning(plan, (1, 2, 3, 4))
    outputs = {}
    pruning.at(2)
    for block in range(2):
        for name in ("attn", "ffn"):
            outputs[block, name] = torch.full((2, 9, 1), float(10 * block + len(name)))
            assert pruning.keep(block, name, torch.randn(2, 9, 1)) is None
            pruning.restore(block, name, outputs[block, name], None)
    pruning.at(3)
    for block in range(2):
        for name in ("attn", "ffn"):
            kept = pruning.keep(block, name, torch.randn(2, 16, 1))
            restored = pruning.restore(block, name, torch.zeros(2, 8, 1), kept)
            assert set(restored.unique().tolist()) == {0.0, 10.0 * block + len(name)}


def test_skipped_scales_never_run_and_add_nothing_to_the_image():
    plain_codes, skipped_codes = [], []
    run(codes=plain_codes)
    f_hat, stats = run(ScaleAcceleration(skip_last=2), codes=skipped_codes)
    assert len(skipped_codes) == 2 and all(torch.equal(a, b) for a, b in zip(plain_codes, skipped_codes))
    vqvae, expect = tiny_vqvae(), torch.zeros_like(f_hat)
    for scale, codes in enumerate(skipped_codes):
        expect, _ = vqvae.next_input(expect, codes, scale, (1, 2, 3, 4))
    assert torch.equal(f_hat, expect)
    assert stats.target_forwards == 2 and stats.tokens == 5 and stats.recomputed_share[2:] == [0.0, 0.0]


def test_unconditional_branch_replacement_runs_the_conditional_rows_alone_with_their_logits_unguided():
    """At every scale without the unconditional branch the image is the unguided sampler's (cfg 0: conditional
    rows only), and the unconditional rows' cache slots stay unwritten."""
    model = tiny_var()
    unguided, _ = run(sampling=SamplingSettings(cfg_scale=0.0, top_k=8))
    _, _, session, _ = spied_run(ScaleAcceleration(uncond_last=4), model)
    replaced, stats = run(ScaleAcceleration(uncond_last=4))
    torch.testing.assert_close(replaced, unguided)
    assert not session.caches[0].k[2:].any() and session.caches[0].k[:2, :, :30].abs().sum(-1).all()
    assert stats.recomputed_share == [0.5] * 4
    partly, _ = run(ScaleAcceleration(uncond_last=1))
    plain_codes, partly_codes = [], []
    run(codes=plain_codes), run(ScaleAcceleration(uncond_last=1), codes=partly_codes)
    assert all(torch.equal(a, b) for a, b in zip(plain_codes[:3], partly_codes[:3]))


def test_default_schedule_from_the_end_of_vars_schedule():
    """Cache at the fifth scale from the end, prune 0.4 and 0.5 at the next two, skip the last two; the blocks
    near the input and the output (Infinity-2B's 3 and 4 of 32, in proportion) run in full."""
    plan = FASTVAR.plan(10, 16)  # VAR-d16 at 256 px: 1 2 3 4 5 6 8 10 13 16
    assert plan.runs == 8 and plan.cache_scale == 5 and plan.ratios == {6: 0.4, 7: 0.5}
    assert pruned_blocks(16) == range(2, 14) and pruned_blocks(30) == range(3, 26) and pruned_blocks(4) == range(4)


@pytest.mark.parametrize("acceleration, message", [
    (ScaleAcceleration(prune_ratios=(1.0,)), "not in [0, 1)"),
    (ScaleAcceleration(prune_ratios=(-0.1,)), "not in [0, 1)"),
    (ScaleAcceleration(skip_last=4), "leaves none"),
    (ScaleAcceleration(skip_last=-1), "0 or more"),
    (ScaleAcceleration(prune_ratios=(0.1, 0.2, 0.3, 0.4)), "give fewer ratios"),
    (ScaleAcceleration(prune_ratios=(0.1,), skip_last=3), "give fewer ratios"),
    (ScaleAcceleration(uncond_last=5), "only 4"),
])
def test_out_of_range_settings_are_refused_in_words(acceleration, message):
    with pytest.raises(FastARError, match=message.replace("[", r"\[").replace(")", r"\)").replace("(", r"\(")):
        run(acceleration)


def test_a_session_without_the_hook_is_refused():
    model = tiny_var()
    start = model.start

    class Plain:
        def __init__(self, session):
            self.forward = session.forward

    model.start = lambda *a, **k: Plain(start(*a, **k))
    with pytest.raises(FastARError, match="FastVAR and SkipVAR act on"):
        run(FASTVAR.__class__(prune_ratios=(0.5,)), model)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_on_the_cpu(dtype):
    f_hat, stats = run(ScaleAcceleration(prune_ratios=(0.4, 0.5), uncond_last=1), tiny_var().to(dtype))
    assert torch.isfinite(f_hat).all() and stats.transformer_work < 1.0


def test_flags_map_to_the_settings():
    from fastar.cli import build_parser
    from fastar.settings import acceleration_from

    parse = lambda *flags: acceleration_from(build_parser().parse_args(["generate", *flags]))  # noqa: E731
    assert parse() is None and parse("--skip-scales", "0") is None
    assert parse("--fastvar") == FASTVAR
    assert parse("--fastvar", "--skip-scales", "0") == ScaleAcceleration(prune_ratios=(0.4, 0.5))
    assert parse("--fastvar-ratios", "0.3") == ScaleAcceleration(prune_ratios=(0.3,), skip_last=2)
    assert parse("--skip-scales", "1", "--uncond-scales", "2") == ScaleAcceleration(skip_last=1, uncond_last=2)
    for flags, message in ((("--fastvar-ratios", "0.4,x"), "comma-separated"), (("--fastvar-ratios", "1"), r"\[0, 1\)"),
                           (("--uncond-scales", "-1"), "0 or more")):
        with pytest.raises(FastARError, match=message):
            parse(*flags)


def test_generate_on_the_demo_var_reports_the_saving_and_refuses_a_token_model(tmp_path):
    import json
    import subprocess
    import sys

    from fastar.model_loaders.shared.demo import DEMO_VAR, DEMO_VAR_VQVAE

    def generate(*flags):
        return subprocess.run([sys.executable, "-m", "fastar", "generate", "--quiet", "--out", str(tmp_path / "x.png"),
                               "--stats-out", str(tmp_path / "s.json"), *flags], capture_output=True, text=True,
                              cwd=tmp_path, timeout=300)

    r = generate("--model", str(DEMO_VAR), "--vq", str(DEMO_VAR_VQVAE), "--fastvar", "--uncond-scales", "1")
    assert r.returncode == 0, r.stderr
    assert "scale acceleration: tokens forwarded per scale 1/4/6/4/0/0"  # 8 kept, conditional rows only in r.stdout
    stats = json.loads((tmp_path / "s.json").read_text())
    assert stats["target_forwards"] == 4 and stats["settings"]["scale_acceleration"]["skip_last"] == 2
    r = generate("--fastvar")  # the demo token model
    assert r.returncode != 0 and "act on a VAR model's scales" in r.stderr


def test_bench_var_measures_every_row_at_the_same_classes_and_counts_the_work(tmp_path):
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "fastar", "bench", "--var", "--samples", "8", "--timing-runs", "1",
                        "--out", str(tmp_path)], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr
    results = json.loads((tmp_path / "bench_var.json").read_text())["results"]
    assert results["ar"]["tokens_forwarded"] == 130 and results["ar"]["frechet_vs_ar"] == 0.0
    assert results["fastvar"]["tokens_forwarded"] == 1 + 4 + 6 + 8 and results["fastvar"]["forwards_per_image"] == 4
    assert results["skip-1"]["per_scale"] == [1, 4, 9, 16, 36, 0]
    assert results["uncond-2"]["flops_share"] < 1.0 and results["ar-reseeded"]["frechet_vs_ar"] > 0.0
    assert "| fastvar-prune | 6 | 84.0 |" in (tmp_path / "bench_var.md").read_text()


def test_the_flow_map_sampler_takes_the_same_options_deterministically():
    model, vqvae = tiny_var(), tiny_vqvae()
    runs = [decode_next_scale(model, ROWS, SAMPLING, seed=0, vqvae=vqvae, decoder="fm",
                              acceleration=ScaleAcceleration(prune_ratios=(0.5,), skip_last=1, uncond_last=1))
            for _ in range(2)]
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1].target_forwards == 3
