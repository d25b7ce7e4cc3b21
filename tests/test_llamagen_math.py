"""Pins the LlamaGen GPT math that compatibility with official checkpoints depends on."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from fastar.model_loaders.llamagen import model as llamagen_gpt
from fastar.model_loaders.llamagen.model import Attention, apply_rope, rope_2d_table
from fastar.model_loaders.shared.joined import parted_state_dict
from fastar.model_loaders.shared.transformer import RMSNorm
from fastar.model_loaders.shared.protocol import CaptionConditioning, ClassConditioning
from tiny_llamagen import NUM_CLASSES, tiny_conditioning, tiny_config, tiny_model, tiny_tokens


# -- 2-D RoPE --------------------------------------------------------------------------------------


def test_rope_table_rows_then_columns_with_official_frequencies():
    head_dim, grid, cond_len = 16, (2, 3), 2
    table = rope_2d_table(grid, head_dim, cond_len, extra=0, base=10000.0)
    assert table.shape == (cond_len + 6, head_dim // 2, 2)
    assert torch.all(table[:cond_len] == 0)  # cond positions: cos = sin = 0
    # head_dim 16: 8 pairs; frequencies 10000 ** (-2i / 8) for i < 4 = 1, 0.1, 0.01, 0.001;
    # pairs 0-3 rotate by the row index, pairs 4-7 by the column index.
    freqs = [1.0, 0.1, 0.01, 0.001]
    for token in range(6):
        row, col = divmod(token, 3)
        angles = [row * f for f in freqs] + [col * f for f in freqs]
        expected = torch.tensor([[math.cos(a), math.sin(a)] for a in angles])
        assert_close(table[cond_len + token], expected, atol=1e-6, rtol=0)
    # token 5 sits at row 1, column 2: its first pair turns by 1 radian, its fifth by 2
    assert_close(table[cond_len + 5, 0], torch.tensor([math.cos(1.0), math.sin(1.0)]))
    assert_close(table[cond_len + 5, 4], torch.tensor([math.cos(2.0), math.sin(2.0)]))


def test_rope_rotates_interleaved_channel_pairs():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 3, 2, 8, generator=generator)
    angles = torch.rand(1, 3, 4, generator=generator) * 6
    table = torch.stack([angles.cos(), angles.sin()], dim=-1)
    out = apply_rope(x, table)
    for t in range(3):
        for h in range(2):
            for p in range(4):
                re_, im = x[0, t, h, 2 * p], x[0, t, h, 2 * p + 1]
                c, s = math.cos(angles[0, t, p]), math.sin(angles[0, t, p])
                assert_close(out[0, t, h, 2 * p], re_ * c - im * s)
                assert_close(out[0, t, h, 2 * p + 1], im * c + re_ * s)


@pytest.mark.parametrize("model_type", ["c2i", "t2i"])
def test_cond_positions_have_zero_queries_and_keys(monkeypatch, model_type):
    model = tiny_model(model_type)
    rotated = []

    def recording_rope(x, table):
        out = apply_rope(x, table)
        rotated.append(out)
        return out

    monkeypatch.setattr(llamagen_gpt, "apply_rope", recording_rope)
    model.training_logits(tiny_conditioning(model), tiny_tokens(model))
    cond_len = model.cfg.cls_token_num
    assert len(rotated) == 2 * model.cfg.n_layer  # q and k of every layer
    for out in rotated:
        assert torch.all(out[:, :cond_len] == 0)
        assert out[:, cond_len:].abs().sum() > 0


# -- RMSNorm, GQA --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rmsnorm_computes_in_fp32(dtype):
    norm = RMSNorm(8, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 8))
    x = (torch.linspace(-1, 1, 16).reshape(2, 8) * 1000 + 500).to(dtype)  # squares overflow fp16
    xf = x.float()
    expected = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype) * norm.weight
    out = norm(x)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert torch.equal(out, expected)


def test_gqa_heads_share_consecutive_kv_heads():
    cfg = tiny_config(n_head=4, n_kv_head=2)
    attn = Attention(cfg)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
    B, T, hd = 2, 5, cfg.head_dim
    x = torch.randn(B, T, cfg.dim, generator=generator)
    rope = rope_2d_table(cfg.grid, hd, 1, 0, 10000.0)[:T].expand(B, -1, -1, -1)
    mask = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    q, k, v = (x @ attn.wqkv.weight.T).split([4 * hd, 2 * hd, 2 * hd], dim=-1)
    q = apply_rope(q.view(B, T, 4, hd), rope).transpose(1, 2)
    k = apply_rope(k.view(B, T, 2, hd), rope).transpose(1, 2).repeat_interleave(2, dim=1)  # head h -> h // 2
    v = v.view(B, T, 2, hd).transpose(1, 2).repeat_interleave(2, dim=1)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(~mask, float("-inf"))
    expected = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, -1) @ attn.wo.weight.T
    assert_close(attn(x, rope, mask), expected, atol=1e-5, rtol=1e-5)


# -- KV cache --------------------------------------------------------------------------------------


def null_conditioning(model, conditioning):
    """What the uncond (CFG) rows see: the null class, or the null caption with the cond rows' mask."""
    if model.cfg.model_type == "c2i":
        return ClassConditioning(torch.full_like(conditioning.labels, NUM_CLASSES))
    null = model.cls_embedding.uncond_embedding.expand_as(conditioning.embeddings)
    return CaptionConditioning(null, conditioning.mask)


@pytest.mark.parametrize("model_type", ["c2i", "t2i"])
def test_windowed_cache_forwards_match_teacher_forcing(model_type):
    """Rows advance by different amounts per call, windows carry rejected junk that the next call must
    overwrite, and both CFG halves match the full teacher-forced forward."""
    model = tiny_model(model_type, n_kv_head=2)
    conditioning, tokens = tiny_conditioning(model), tiny_tokens(model)
    N, W = tokens.shape[1], 4
    expected_cond = model.training_logits(conditioning, tokens)
    expected_uncond = model.training_logits(null_conditioning(model, conditioning), tokens)
    session = model.start(conditioning, cfg=True, max_window=W)
    assert_close(session.first.cond[:, 0], expected_cond[:, 0], atol=1e-5, rtol=1e-5)
    assert_close(session.first.uncond[:, 0], expected_uncond[:, 0], atol=1e-5, rtol=1e-5)

    accept_cycles = [(1, 3, 2, 4), (4, 1, 2)]
    junk = torch.Generator().manual_seed(5)
    got_cond, got_uncond = torch.full_like(expected_cond, torch.nan), torch.full_like(expected_uncond, torch.nan)
    got_cond[:, 0], got_uncond[:, 0] = expected_cond[:, 0], expected_uncond[:, 0]
    done, step = [0, 0], 0
    while min(done) < N - 1:
        window = torch.randint(0, model.vocab_size, (2, W), generator=junk)
        accepts = [cycle[step % len(cycle)] for cycle in accept_cycles]
        for b in range(2):
            real = tokens[b, done[b] : done[b] + accepts[b]]
            window[b, : len(real)] = real
        out = session.forward(window, torch.tensor(done))
        for b in range(2):
            kept = min(accepts[b], N - 1 - done[b])  # outputs predicting accepted, existing tokens
            got_cond[b, done[b] + 1 : done[b] + 1 + kept] = out.cond[b, :kept]
            got_uncond[b, done[b] + 1 : done[b] + 1 + kept] = out.uncond[b, :kept]
            done[b] += kept
        step += 1
    assert_close(got_cond, expected_cond, atol=1e-5, rtol=1e-5)  # a NaN left means a token never checked
    assert_close(got_uncond, expected_uncond, atol=1e-5, rtol=1e-5)


# -- t2i conditioning ------------------------------------------------------------------------------


def test_padded_caption_positions_do_not_affect_image_logits():
    model = tiny_model("t2i")
    conditioning, tokens = tiny_conditioning(model), tiny_tokens(model)
    noise = torch.randn(conditioning.embeddings.shape, generator=torch.Generator().manual_seed(9))
    garbled = CaptionConditioning(torch.where(conditioning.mask[..., None], conditioning.embeddings, noise),
                                  conditioning.mask)
    assert_close(model.training_logits(garbled, tokens), model.training_logits(conditioning, tokens))
    first = model.start(conditioning, cfg=False, max_window=2).first.cond
    assert_close(model.start(garbled, cfg=False, max_window=2).first.cond, first)
    # ...while a real caption position does matter
    changed = conditioning.embeddings.clone()
    changed[:, -1] += 1.0
    moved = model.start(CaptionConditioning(changed, conditioning.mask), cfg=False, max_window=2).first.cond
    assert (moved - first).abs().max() > 1e-3


def test_uncond_branch_uses_the_null_caption():
    model = tiny_model("t2i")
    conditioning = tiny_conditioning(model)
    uncond = model.start(conditioning, cfg=True, max_window=2).first.uncond
    expected = model.start(null_conditioning(model, conditioning), cfg=False, max_window=2).first.cond
    assert_close(uncond, expected)
    with torch.no_grad():
        model.cls_embedding.uncond_embedding.mul_(-1)
    flipped = model.start(conditioning, cfg=True, max_window=2).first.uncond
    assert (flipped - uncond).abs().max() > 1e-3


# -- independent reference -------------------------------------------------------------------------


def reference_logits(sd, cfg, conditioning, tokens):
    """The official forward written out from its formulas, reading weights by their official names: no
    cache, explicit mask matrix, complex-number RoPE, repeat_interleave GQA. Logits [B, N, V]."""
    eps, H, KV = cfg.norm_eps, cfg.n_head, cfg.n_kv_head
    hd, half, side = cfg.dim // H, cfg.dim // H // 2, cfg.grid[0]

    def rmsnorm(x, weight):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * weight

    if cfg.model_type == "c2i":
        cond = sd["cls_embedding.embedding_table.weight"][conditioning.labels][:, None]
        cond_mask = torch.ones(cond.shape[:2], dtype=torch.bool)
    else:
        captions = conditioning.embeddings * conditioning.mask[..., None]
        hidden = F.gelu(captions @ sd["cls_embedding.cap_proj.fc1.weight"].T, approximate="tanh")
        cond, cond_mask = hidden @ sd["cls_embedding.cap_proj.fc2.weight"].T, conditioning.mask
    C = cond.shape[1]
    x = torch.cat([cond, sd["tok_embeddings.weight"][tokens[:, :-1]]], dim=1)
    B, T, _ = x.shape

    freqs = 1.0 / (cfg.rope_base ** (torch.arange(0, half, 2)[: half // 2].float() / half))
    per_side = torch.outer(torch.arange(side).float(), freqs)
    grid_angles = torch.cat([per_side[:, None].expand(-1, side, -1), per_side[None].expand(side, -1, -1)], -1)
    cis = torch.polar(torch.ones(side * side, half), grid_angles.reshape(side * side, half))
    cis = torch.cat([torch.zeros(C, half, dtype=cis.dtype), cis])[:T]

    def rope(v):
        pairs = torch.view_as_complex(v.reshape(*v.shape[:-1], half, 2).contiguous())
        return torch.view_as_real(pairs * cis[None, :, None]).flatten(3)

    allowed = torch.ones(T, T, dtype=torch.bool).tril().repeat(B, 1, 1)
    allowed[:, :, :C] &= cond_mask[:, None, :]
    allowed |= torch.eye(T, dtype=torch.bool)

    for i in range(cfg.n_layer):
        p = f"layers.{i}."
        h = rmsnorm(x, sd[p + "attention_norm.weight"])
        q, k, v = (h @ sd[p + "attention.wqkv.weight"].T).split([H * hd, KV * hd, KV * hd], dim=-1)
        q, k, v = rope(q.view(B, T, H, hd)), rope(k.view(B, T, KV, hd)), v.view(B, T, KV, hd)
        k, v = k.repeat_interleave(H // KV, dim=2), v.repeat_interleave(H // KV, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        weights = scores.masked_fill(~allowed[:, None], float("-inf")).softmax(-1)
        x = x + torch.einsum("bhqk,bkhd->bqhd", weights, v).reshape(B, T, -1) @ sd[p + "attention.wo.weight"].T
        h = rmsnorm(x, sd[p + "ffn_norm.weight"])
        gate, up = h @ sd[p + "feed_forward.w1.weight"].T, h @ sd[p + "feed_forward.w3.weight"].T
        x = x + (F.silu(gate) * up) @ sd[p + "feed_forward.w2.weight"].T
    return (rmsnorm(x, sd["norm.weight"]) @ sd["output.weight"].T)[:, C - 1 :]


@pytest.mark.parametrize("model_type,n_kv_head", [("c2i", 4), ("c2i", 2), ("t2i", 4), ("t2i", 1)])
def test_model_matches_independent_reference(model_type, n_kv_head):
    model = tiny_model(model_type, n_kv_head=n_kv_head)
    conditioning, tokens = tiny_conditioning(model), tiny_tokens(model)
    expected = reference_logits(parted_state_dict(model), model.cfg, conditioning, tokens)
    assert expected.shape == (2, model.cfg.num_tokens, model.vocab_size)
    assert_close(model.training_logits(conditioning, tokens), expected, atol=1e-5, rtol=1e-5)
    session = model.start(conditioning, cfg=False, max_window=model.cfg.num_tokens)
    assert_close(session.first.cond[:, 0], expected[:, 0], atol=1e-5, rtol=1e-5)
    assert_close(session.forward(tokens, torch.zeros(2, dtype=torch.long)).cond[:, :-1], expected[:, 1:],
                 atol=1e-5, rtol=1e-5)
