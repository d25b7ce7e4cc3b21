"""Infinity (bitwise next-scale text-to-image): the release's math pinned on tiny random models by a reference
written out here (a full block-causal pass, no cache), files in the release's layouts load, the scale schedules and
aspect templates, and the sampler's rules (constant guidance, bits as two-way choices through the shared pipeline).
tests/conformance/test_infinity.py holds it against the official code."""
import math

import pytest
import torch
import torch.nn.functional as F

from fastar.errors import FastARError
from fastar.model_loaders import load_ar_model
from fastar.model_loaders.infinity.labels import bits_of, labels_of
from fastar.model_loaders.infinity.model import Infinity
from fastar.model_loaders.infinity.schedules import TEMPLATES, scale_schedule, template_of
from fastar.model_loaders.shared.checkpoint import detect_family
from fastar.model_loaders.shared.protocol import CaptionConditioning, ModelOutput
from fastar.samplers.few_step_loops.next_scale import next_scale_decode
from fastar.samplers.processing import SamplingSettings, probabilities
from tiny_infinity import TEXT, captions, release_state_dict, tiny_infinity, tiny_vae


# -- the reference: the release's rules written out ------------------------------------------------------------


def attend(q, k, v, scale, mask=None):
    logits = q @ k.transpose(-1, -2) * scale
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    return logits.softmax(-1) @ v


def heads(t, n):
    return t.view(*t.shape[:2], n, -1).transpose(1, 2)


def rope_tables(model, head_dim):
    """cos, sin [L, head_dim/2]: pair p < head_dim/4 turns by the row, the rest by the column, positions
    round(i * H / h) and round(j * W / w) of the template's 1M grid (H, W)."""
    H, W = model.cfg.rope_grid
    quarter = head_dim // 4
    freqs = [10000 ** (-2 * j / (2 * quarter)) for j in range(quarter)]
    angles = []
    for h, w in model.cfg.scales:
        for i in range(h):
            for j in range(w):
                row, col = round(i * H / h), round(j * W / w)
                angles.append([row * f for f in freqs] + [col * f for f in freqs])
    angles = torch.tensor(angles, dtype=torch.float64).float()
    return angles.cos(), angles.sin()


def turn(x, cos, sin):
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
    return out


def reference_logits(model: Infinity, text, mask, inputs):
    """Every scale's bit logits ``[R, L, 2 * bits]`` in one pass: ``text`` [R, T, Ct5] (rows already cond + uncond),
    ``inputs`` [R, L - 1, bits] the scales' inputs after the first."""
    cfg, C = model.cfg, model.cfg.dim
    t = text.float()
    normed = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * model.text_norm.weight
    pool = model.text_proj_for_sos.ca
    kv = normed @ pool.mat_kv.weight.T + torch.cat([torch.zeros(C), pool.v_bias])
    k, v = heads(kv[..., :C], cfg.pool_heads), heads(kv[..., C:], cfg.pool_heads)
    q = pool.mat_q[:, :, None].expand(t.shape[0], -1, -1, -1)  # one learned query a head: [R, H, 1, hd]
    pooled = attend(q, k, v, (C // cfg.pool_heads) ** -0.5, mask[:, None, None])
    cond = pool.proj(pooled.transpose(1, 2).reshape(t.shape[0], C))
    gss = model.shared_ada_lin[1](F.silu(cond)).view(-1, 1, 6, C)
    context = model.text_proj_for_ca(normed)
    levels = torch.cat([torch.full((h * w,), s) for s, (h, w) in enumerate(cfg.scales)])
    x = torch.cat([(cond + model.pos_start[0])[:, None], model.word_embed(inputs)], 1)
    x = x + model.lvl_embed.weight[levels]  # once, before the first block
    causal = levels[:, None] >= levels[None, :]
    hd = C // cfg.n_head
    cos, sin = rope_tables(model, hd)
    ln = lambda y: F.layer_norm(y, (C,), eps=1e-6)  # noqa: E731
    for block in model.blocks:
        g1, g2, s1, s2, b1, b2 = (block.ada_gss + gss).unbind(2)
        a = ln(x) * (1 + s1) + b1
        qkv = a @ block.sa.mat_qkv.weight.T
        q = qkv[..., :C] + block.sa.q_bias
        k, v = qkv[..., C:2 * C], qkv[..., 2 * C:] + block.sa.v_bias
        q, k, v = heads(q, cfg.n_head), heads(k, cfg.n_head), heads(v, cfg.n_head)
        q = q / q.norm(dim=-1, keepdim=True) * torch.exp(torch.clamp(block.sa.scale_mul_1H11, max=math.log(100)))
        k = k / k.norm(dim=-1, keepdim=True)
        out = attend(turn(q, cos, sin), turn(k, cos, sin), v, 1.0, causal)
        x = x + block.sa.proj(out.transpose(1, 2).flatten(2)) * g1
        cq = heads(block.ca.mat_q(F.layer_norm(x, (C,), block.ca_norm.weight, block.ca_norm.bias, 1e-6)), cfg.n_head)
        ckv = context @ block.ca.mat_kv.weight.T + torch.cat([torch.zeros(C), block.ca.v_bias])
        ck, cv = heads(ckv[..., :C], cfg.n_head), heads(ckv[..., C:], cfg.n_head)
        x = x + block.ca.proj(attend(cq, ck, cv, hd ** -0.5, mask[:, None, None]).transpose(1, 2).flatten(2))
        f = ln(x) * (1 + s2) + b2
        x = x + block.ffn.fc2(F.gelu(block.ffn.fc1(f), approximate="tanh")) * g2
    scale, shift = model.head_nm.ada_lin[1](F.silu(cond)).view(-1, 1, 2, C).unbind(2)
    return model.head(ln(x) * (1 + scale) + shift)


def random_inputs(model, rows, seed=5):
    return torch.randn(rows, model.cfg.seq_len - 1, model.cfg.bits, generator=torch.Generator().manual_seed(seed))


def session_logits(model, conditioning, inputs, cfg=True):
    """Each scale's (cond, uncond) logits from a session, joined ``[B, L * bits, 2]``."""
    session = model.start(conditioning, cfg=cfg)
    outs = []
    for scale, (begin, end) in enumerate(model.cfg.scale_bounds()):
        outs.append(session.forward(scale, None if scale == 0 else inputs[:, begin - 1:end - 1]))
    cond = torch.cat([o.cond for o in outs], 1)
    return cond, (torch.cat([o.uncond for o in outs], 1) if cfg else None)


def test_the_session_follows_the_release_math_scale_by_scale():
    model = tiny_infinity(aspect_ratio="3:4")  # non-square scales: RoPE rows and columns apart
    with torch.no_grad():
        model.blocks[1].sa.scale_mul_1H11[0, 0] = 6.0  # above ln 100: the clamp must hold it there
        rows = captions((5, 3))
        inputs = random_inputs(model, 2)
        cond, uncond = session_logits(model, rows, inputs)
        uncond_text = model.cfg_uncond[:5].expand(2, -1, -1) * rows.mask[..., None]
        text, mask = torch.cat([rows.embeddings, uncond_text]), torch.cat([rows.mask, rows.mask])
        expected = reference_logits(model, text, mask, inputs.repeat(2, 1, 1))
    # fp32 rounding of the cosines times up to 100 and of the position products: about 1e-4 between two right answers
    torch.testing.assert_close(cond.flatten(1), expected[:2].flatten(1), rtol=1e-3, atol=2e-4)
    torch.testing.assert_close(uncond.flatten(1), expected[2:].flatten(1), rtol=1e-3, atol=2e-4)


def test_rows_of_different_caption_lengths_equal_each_row_alone():
    """Padding is masked everywhere (pool and cross-attention) and each unconditional row reads ``cfg_uncond[:n]``
    of its own prompt's n tokens."""
    model = tiny_infinity()
    rows = captions((6, 2))
    inputs = random_inputs(model, 2)
    with torch.no_grad():
        cond, uncond = session_logits(model, rows, inputs)
        for i, n in enumerate((6, 2)):
            alone = CaptionConditioning(rows.embeddings[i:i + 1, :n], rows.mask[i:i + 1, :n])
            c, u = session_logits(model, alone, inputs[i:i + 1])
            torch.testing.assert_close(cond[i:i + 1], c, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(uncond[i:i + 1], u, rtol=1e-4, atol=1e-5)
        as_prompt = CaptionConditioning(model.cfg_uncond[None, :2], torch.ones(1, 2, dtype=torch.bool))
        torch.testing.assert_close(uncond[1:], session_logits(model, as_prompt, inputs[1:], cfg=False)[0],
                                   rtol=1e-4, atol=1e-5)


# -- bits, labels, the 8B's patches ----------------------------------------------------------------------------


def test_each_bit_is_an_interleaved_pair_of_logits_and_labels_put_bit_0_first():
    model = tiny_infinity()
    pattern = torch.tensor([1, 0, 0, 1, 1, 1, 0, 1])
    with torch.no_grad():
        model.head.weight.zero_()
        model.head.bias.copy_(torch.stack([1 - pattern, pattern], 1).flatten().float() * 5)  # (bit=0, bit=1) pairs
    drawn = []
    next_scale_decode(model, tiny_vae(), captions(), SamplingSettings(cfg_scale=3.0, temperature=0.0),
                      generator=torch.Generator().manual_seed(0), scale_codes=drawn)
    assert all(torch.equal(bits, pattern.expand_as(bits)) for bits in drawn)
    assert labels_of(pattern).item() == 0b10011101
    assert torch.equal(bits_of(labels_of(drawn[2]), 8), drawn[2])


def test_the_8b_folds_2x2_cells_into_a_token_as_pixel_shuffle_does():
    model, vae = tiny_infinity(bits=16, patchify=True), tiny_vae(16, patchify=True)
    assert model.cfg.bits == 16 and model.vae_bits == 4 and model.f_hat_shape == (4, 32, 32)
    bits = torch.randint(0, 2, (2, 4, 4, 16), generator=torch.Generator().manual_seed(1))
    cells = model.to_vae_grid(bits)
    for c, i, j in ((0, 0, 0), (3, 1, 0), (2, 0, 1), (1, 1, 1)):  # channel c*4 + 2i + j goes to cell (2y+i, 2x+j)
        assert torch.equal(cells[:, i::2, j::2, c], bits[..., c * 4 + 2 * i + j])
    f_hat = torch.zeros(2, *model.f_hat_shape)
    f_hat, inputs = model.next_input(vae, f_hat, bits, 2)
    expected_f_hat, expected = vae.next_input(torch.zeros(2, *model.f_hat_shape), cells, 2, model.vae_shapes())
    torch.testing.assert_close(f_hat, expected_f_hat)
    torch.testing.assert_close(inputs, F.pixel_unshuffle(expected, 2).flatten(2).transpose(1, 2))
    assert inputs.shape == (2, 36, 16)  # scale 3's 6 x 6 tokens


# -- the sampler -----------------------------------------------------------------------------------------------


def test_guidance_is_constant_over_the_scales_and_greedy_is_the_argmax_of_each_bit():
    model, vae = tiny_infinity(), tiny_vae()
    rows = captions()
    drawn = []
    f_hat, stats = next_scale_decode(model, vae, rows, SamplingSettings(cfg_scale=3.0, temperature=0.0),
                                     generator=torch.Generator().manual_seed(0), scale_codes=drawn)
    assert stats.target_forwards == 7 and stats.tokens == 521 and f_hat.shape == (2, 8, 16, 16)
    assert stats.settings["scales"][-1] == [16, 16]
    with torch.no_grad():
        session = model.start(rows, cfg=True)
        expected, inputs = torch.zeros(2, 8, 16, 16), None
        for scale, (h, w) in enumerate(model.scale_shapes):
            out = session.forward(scale, inputs)
            bits = (out.uncond + 3.0 * (out.cond - out.uncond)).argmax(-1).view(2, h, w, 8)
            assert torch.equal(bits, drawn[scale]), scale
            expected, inputs = model.next_input(vae, expected, bits, scale)
    torch.testing.assert_close(f_hat, expected)
    _, unguided = next_scale_decode(model, vae, rows, SamplingSettings(cfg_scale=1.0, temperature=0.0),
                                    generator=torch.Generator().manual_seed(0))
    assert unguided.settings["cfg_scale"] == 1.0  # 1 turns guidance off: no unconditional rows


@pytest.mark.parametrize("sampling", [SamplingSettings(cfg_scale=3.0, temperature=0.5, top_k=900, top_p=0.97),
                                      SamplingSettings(cfg_scale=4.0, temperature=1.3, top_k=1),
                                      SamplingSettings(cfg_scale=1.0, temperature=2.0, top_p=0.6)])
def test_seeded_sampling_is_reproducible_and_every_code_a_bit(sampling):
    model, vae = tiny_infinity(), tiny_vae()
    runs = []
    for seed in (3, 3, 4):
        drawn = []
        next_scale_decode(model, vae, captions(), sampling, generator=torch.Generator().manual_seed(seed),
                          scale_codes=drawn)
        runs.append(torch.cat([d.flatten() for d in drawn]))
    assert torch.equal(runs[0], runs[1]) and set(runs[0].unique().tolist()) <= {0, 1}
    assert not torch.equal(runs[0], runs[2]) or sampling.top_k == 1  # top-k 1: greedy whatever the seed


def test_the_pipelines_top_k_and_top_p_on_two_way_choices_are_the_releases():
    """The release (sample_with_top_k_top_p_also_inplace_modifying_logits_): top-k keeps logits not below the k-th
    largest (k past 2 keeps both); top-p drops the smaller choice when its probability is at most 1 - top_p."""
    logits = torch.randn(4000, 2, generator=torch.Generator().manual_seed(0)) * 3
    out = ModelOutput(logits)
    for top_p in (0.97, 0.8, 0.55):
        kept = probabilities(out, SamplingSettings(1.0, top_p=top_p)) > 0
        small = logits.softmax(-1).min(-1)
        release = torch.ones_like(kept)
        release[torch.arange(4000), small.indices] = small.values > 1 - top_p
        assert torch.equal(kept, release), top_p
    for top_k, both in ((900, True), (1, False)):
        kept = probabilities(out, SamplingSettings(1.0, top_k=top_k)) > 0
        assert bool(kept.all(-1).all()) == both and bool(kept.any(-1).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs_on_the_cpu_near_fp32(dtype):
    model, rows = tiny_infinity(), captions()
    inputs = random_inputs(model, 2)
    with torch.no_grad():
        full, _ = session_logits(model, rows, inputs)
        half, half_uncond = session_logits(model.to(dtype), rows, inputs)
    assert half.dtype == torch.float32 and torch.isfinite(half).all() and torch.isfinite(half_uncond).all()
    spread = full.std().item()
    assert (half - full).abs().mean().item() < 0.05 * spread, (half - full).abs().mean()
    f_hat, _ = next_scale_decode(model, tiny_vae(), rows, SamplingSettings(cfg_scale=3.0, temperature=0.5),
                                 generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(f_hat).all()


# -- files, sizes, schedules -----------------------------------------------------------------------------------


def test_an_infinity_file_loads_as_infinity_where_it_was_taken_for_var_d36(tmp_path):
    """Infinity shares VAR's key names (word_embed, lvl_embed, shared_ada_lin, head_nm.ada_lin): it used to be
    refused as 'shared AdaLN (VAR-d36)'. A VAR file with shared AdaLN still is."""
    from tiny_var import release_var_state_dict, tiny_var

    model = tiny_infinity()
    sd = release_state_dict(model)
    assert detect_family(sd) == "infinity"
    torch.save(sd, tmp_path / "infinity_tiny.pth")
    loaded = load_ar_model(tmp_path / "infinity_tiny.pth", image_size=256)
    assert isinstance(loaded, Infinity) and loaded.cfg == model.cfg
    var_d36 = {**release_var_state_dict(tiny_var()), "shared_ada_lin.1.weight": torch.zeros(6 * 32, 32)}
    assert detect_family(var_d36) == "var"
    torch.save(var_d36, tmp_path / "var_d36.pth")
    with pytest.raises(FastARError, match=r"uses shared AdaLN \(VAR-d36"):
        load_ar_model(tmp_path / "var_d36.pth")


def test_sizes_come_from_the_weights_and_every_release_layout_loads_the_same(tmp_path):
    from safetensors.torch import save_file

    model = tiny_infinity(depth=4)
    sd = release_state_dict(model)
    torch.save({**sd, "lvl_1L": torch.zeros(1, 3), "attn_bias_for_masking": torch.zeros(1, 1, 3, 3)},
               tmp_path / "raw.pth")  # buffers of older training code, which the release's load_state_dict drops
    torch.save({"trainer": {"gpt_fsdp": sd, "gpt_ema_fsdp": {}}, "epoch": 3}, tmp_path / "full.pth")
    shards = tmp_path / "infinity_8b_weights"
    shards.mkdir()
    keys = sorted(sd)
    save_file({k: sd[k].contiguous() for k in keys[:40]}, shards / "model-00001-of-00002.safetensors")
    save_file({k: sd[k].contiguous() for k in keys[40:]}, shards / "model-00002-of-00002.safetensors")
    index = {k: f"model-0000{1 + (i >= 40)}-of-00002.safetensors" for i, k in enumerate(keys)}
    import json

    (shards / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    pickled = tmp_path / "pickled_shards"  # load_sharded_checkpoint's other form
    pickled.mkdir()
    for n, part in enumerate((keys[:40], keys[40:]), start=1):
        torch.save({k: sd[k] for k in part}, pickled / f"pytorch_model-0000{n}-of-00002.bin")
    bin_index = {k: f"pytorch_model-0000{1 + (i >= 40)}-of-00002.bin" for i, k in enumerate(keys)}
    (pickled / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": bin_index}))
    for path in (tmp_path / "raw.pth", tmp_path / "full.pth", shards, pickled):
        loaded = load_ar_model(path, image_size=256)
        cfg = loaded.cfg
        assert (cfg.depth, cfg.dim, cfg.n_head, cfg.ffn_hidden, cfg.text_channels, cfg.pool_heads, cfg.bits,
                cfg.patchify, cfg.text_tokens) == (4, 32, 2, 64, TEXT, 2, 8, False, 12), path.name
        for (name, x), y in zip(model.state_dict().items(), loaded.state_dict().values()):
            torch.testing.assert_close(x, y, msg=f"{path.name}: {name}")
    wide = tiny_infinity(bits=56 * 1)  # 56 bits a token: the 8B's 2 x 2 cells of 14
    torch.save(release_state_dict(wide), tmp_path / "eight.pth")
    assert load_ar_model(tmp_path / "eight.pth", image_size=256).cfg.patchify
    (tmp_path / "raw.json").write_text('{"apply_spatial_patchify": 1}')  # other bit counts say so beside the file
    assert load_ar_model(tmp_path / "raw.pth", image_size=256).cfg.patchify


def test_schedules_sizes_and_aspect_ratios():
    assert len(TEMPLATES) == 15 and list(TEMPLATES)[:5] == [1.0, 1.25, 0.8, 1.333, 0.75]
    assert [len(scale_schedule(size, None)[0]) for size in (256, 512, 768, 1024)] == [7, 10, 12, 13]
    assert scale_schedule(None, None) == scale_schedule(1024, "1:1")
    assert scale_schedule(256, "1:1") == ([(1, 1), (2, 2), (4, 4), (6, 6), (8, 8), (12, 12), (16, 16)], (64, 64))
    scales, rope = scale_schedule(1024, "16:9")  # h/w 0.5625: the 0.571 template (4:7)
    assert template_of("16:9") == 0.571 and scales[-1] == (48, 84) and rope == (48, 84)
    assert scale_schedule(512, "3:4")[0][-1] == (36, 27) and template_of("2:3") == 1.5
    model = load_ar_model_of(tiny_infinity(), image_size=512, aspect_ratio="21:9")
    assert model.grid == (20, 50) and model.cfg.rope_grid == (40, 100)  # the 0.4 template (5:2)
    for size, ratio, message in ((640, None, r"image size 640: Infinity draws 256, 512, 768, 1024 px"),
                                 (256, "4:1", r"ratio 4:1: .*\(1:1, 4:5, 5:4, 3:4, 4:3, 2:3, 3:2, 4:7, 7:4, 1:2"),
                                 (256, "wide", "WIDTH:HEIGHT")):
        with pytest.raises(FastARError, match=message):
            scale_schedule(size, ratio)


def load_ar_model_of(model, **kw):
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "infinity_tiny.pth"
        torch.save(release_state_dict(model), path)
        return load_ar_model(path, **kw)


# -- what users can get wrong ----------------------------------------------------------------------------------


def test_damaged_and_wrong_files_and_bad_captions_are_refused_in_words(tmp_path):
    model = tiny_infinity()
    torch.save(release_state_dict(model), tmp_path / "good.pth")
    data = (tmp_path / "good.pth").read_bytes()
    (tmp_path / "cut.pth").write_bytes(data[: len(data) // 2])
    with pytest.raises(FastARError, match="truncated or corrupt"):
        load_ar_model(tmp_path / "cut.pth")
    sd = release_state_dict(model)
    del sd["block_chunks.1.module.0.ffn.fc2.weight"]
    torch.save(sd, tmp_path / "missing.pth")
    with pytest.raises(FastARError, match=r"missing blocks\.1\.ffn\.fc2\.weight"):
        load_ar_model(tmp_path / "missing.pth")
    del sd["word_embed.weight"]
    torch.save(sd, tmp_path / "no_embed.pth")
    with pytest.raises(FastARError, match="no_embed.pth has no word_embed.weight weight: the file is incomplete"):
        load_ar_model(tmp_path / "no_embed.pth")
    vae = tiny_vae()
    with pytest.raises(FastARError, match="needs its BSQ VAE as the image decoder"):
        next_scale_decode(model, None, captions(), SamplingSettings(3.0), generator=None)
    with pytest.raises(FastARError, match="works with a d8 VAE .* this VAE is a d4 VAE"):
        next_scale_decode(model, tiny_vae(4), captions(), SamplingSettings(3.0), generator=None)
    good = captions()
    for conditioning, message in (
            (CaptionConditioning(good.embeddings[..., :8], good.mask), r"reads \[B, T, 16\]"),
            (CaptionConditioning(good.embeddings, good.mask.flip(1)), "real tokens first"),
            (CaptionConditioning(torch.zeros(1, 13, TEXT), torch.ones(1, 13, dtype=torch.bool)), "at most 12")):
        with pytest.raises(FastARError, match=message):
            next_scale_decode(model, vae, conditioning, SamplingSettings(3.0), generator=None)


def test_label_files_give_the_bits_back_and_bad_ones_are_refused():
    from fastar.model_loaders.infinity.labels import f_hat_of_labels

    model, vae = tiny_infinity(bits=16, patchify=True), tiny_vae(16, patchify=True)
    g = torch.Generator().manual_seed(2)
    f_hat, tokens = torch.zeros(2, *model.f_hat_shape), [[], []]
    for scale, (h, w) in enumerate(model.scale_shapes):
        bits = torch.randint(0, 2, (2, h, w, 16), generator=g)
        f_hat, _ = model.next_input(vae, f_hat, bits, scale)
        for row, labels in enumerate(labels_of(model.to_vae_grid(bits))):
            tokens[row].append(labels.flatten().tolist())
    shapes = model.vae_shapes()
    torch.testing.assert_close(f_hat_of_labels(vae, shapes, tokens, 4, "t.json"), f_hat)
    with pytest.raises(FastARError, match="t.json holds labels of 5 bits but the VAE codes 4"):
        f_hat_of_labels(vae, shapes, tokens, 5, "t.json")
    tokens[1][2][0] = 16
    with pytest.raises(FastARError, match=r"t.json: scale 2 should hold 64 labels in 0..15 per image"):
        f_hat_of_labels(vae, shapes, tokens, 4, "t.json")


def test_a_patchified_model_needs_bits_that_fold_into_2x2_cells(tmp_path):
    torch.save(release_state_dict(tiny_infinity(bits=6)), tmp_path / "odd.pth")
    (tmp_path / "odd.json").write_text('{"apply_spatial_patchify": 1}')
    with pytest.raises(FastARError, match="odd.pth: 6 bits per token cannot be 2 x 2 patches"):
        load_ar_model(tmp_path / "odd.pth", image_size=256)


def test_8_bit_weights_run_through_the_layers(tmp_path):
    """int8 blocks (quantized.py) hold codes, not weights: the model calls its layers, and draws nearly fp32's bits."""
    torch.save(release_state_dict(tiny_infinity()), tmp_path / "infinity_tiny.pth")
    drawn = {}
    for weights in ("auto", "int8"):
        model = load_ar_model(tmp_path / "infinity_tiny.pth", image_size=256, weights=weights)
        drawn[weights] = []
        next_scale_decode(model, tiny_vae(), captions(), SamplingSettings(3.0, temperature=0.0),
                          generator=torch.Generator().manual_seed(0), scale_codes=drawn[weights])
    assert type(model.blocks[0].sa.mat_qkv).__name__ == "QuantizedLinear"
    agree = (drawn["auto"][-1] == drawn["int8"][-1]).float().mean()
    assert 0.9 < agree < 1.0, agree  # 8-bit rounding flips a few bits, no more
