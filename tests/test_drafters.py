"""EAGLE drafters in LANTERN's released format, drafter loading with every mismatch refused, LlamaGen's
hidden states, and the drafter trainer's command."""
import dataclasses
import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.testing import assert_close

from fastar.errors import FastARError
from fastar.model_loaders.drafters.small_ar import SmallARDrafter
from fastar.model_loaders.drafters.loader import load_drafter, save_eagle_drafter
from fastar.model_loaders.drafters.eagle import EagleDrafter
from fastar.model_loaders.shared.joined import parted_state_dict
from test_llamagen_math import null_conditioning
from tiny_llamagen import tiny_conditioning, tiny_model, tiny_tokens

WIDTH, HEADS, KV_HEADS, FFN, VOCAB = 32, 4, 2, 40, 50  # the tiny target is 32 wide over 50 codes


def eagle_config(width=WIDTH, vocab=VOCAB, **extra):
    """config.json as LANTERN ships it (HF Llama keys, one layer)."""
    return {"architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "hidden_size": width,
            "intermediate_size": FFN, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "num_hidden_layers": 1, "vocab_size": vocab, "rms_norm_eps": 1e-6, "input_type": "c2i", **extra}


def eagle_weights(width=WIDTH, vocab=VOCAB, fc_bias=True, qkv_bias=False, seed=3):
    """Random weights under the released key names and shapes."""
    hd = width // HEADS
    shapes = {
        "embed_tokens.weight": (vocab, width), "fc.weight": (width, 2 * width),
        "layers.0.self_attn.q_proj.weight": (HEADS * hd, width),
        "layers.0.self_attn.k_proj.weight": (KV_HEADS * hd, width),
        "layers.0.self_attn.v_proj.weight": (KV_HEADS * hd, width),
        "layers.0.self_attn.o_proj.weight": (width, HEADS * hd),
        "layers.0.mlp.gate_proj.weight": (FFN, width), "layers.0.mlp.up_proj.weight": (FFN, width),
        "layers.0.mlp.down_proj.weight": (width, FFN), "layers.0.post_attention_layernorm.weight": (width,),
    }
    if fc_bias:
        shapes["fc.bias"] = (width,)
    if qkv_bias:
        shapes.update({f"layers.0.self_attn.{p}_proj.bias": (shapes[f"layers.0.self_attn.{p}_proj.weight"][0],)
                       for p in "qkv"})
    generator = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=generator) * 0.3 for k, shape in shapes.items()}


def write_drafter(folder, sd, config, fmt="safetensors"):
    folder.mkdir(parents=True)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    if fmt == "bin":
        torch.save(sd, folder / "pytorch_model.bin")
    else:
        save_file(sd, str(folder / "model.safetensors"))
    return folder


def reference_features(sd, config, grid, ids, hidden, prefix):
    """The drafter written out from its formulas for one sequence (no cache): ``ids`` [T], target
    ``hidden`` [T, D] -> features [T, D]. Rows before ``prefix`` get no rotation, row prefix + p sits at
    grid position p; complex-number RoPE, explicit causal mask, repeat_interleave GQA."""
    T, H, KV = len(ids), config["num_attention_heads"], config["num_key_value_heads"]
    D = config["hidden_size"]
    hd, half = D // H, D // H // 2
    x = torch.cat([sd["embed_tokens.weight"][ids], hidden], -1) @ sd["fc.weight"].T + sd.get("fc.bias", 0)
    freqs = 1.0 / (10000.0 ** (torch.arange(0, half, 2)[: half // 2] / half))
    position = (torch.arange(T) - prefix).clamp(min=0)
    rows, cols = position // grid[1] * 1.0, position % grid[1] * 1.0
    angles = torch.cat([torch.outer(rows, freqs), torch.outer(cols, freqs)], -1)
    cis = torch.polar(torch.ones(T, half), angles) * (torch.arange(T) >= prefix)[:, None]

    def rope(v):
        pairs = torch.view_as_complex(v.reshape(T, -1, half, 2).contiguous())
        return torch.view_as_real(pairs * cis[:, None]).flatten(2)

    def proj(name, heads):
        p = f"layers.0.self_attn.{name}_proj."
        return (x @ sd[p + "weight"].T + sd.get(p + "bias", 0)).view(T, heads, hd)

    q, k, v = rope(proj("q", H)), rope(proj("k", KV)), proj("v", KV)
    k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
    weights = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    x = x + torch.einsum("hqk,khd->qhd", weights, v).reshape(T, D) @ sd["layers.0.self_attn.o_proj.weight"].T
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config["rms_norm_eps"])
    h = h * sd["layers.0.post_attention_layernorm.weight"]
    mlp = F.silu(h @ sd["layers.0.mlp.gate_proj.weight"].T) * (h @ sd["layers.0.mlp.up_proj.weight"].T)
    return x + mlp @ sd["layers.0.mlp.down_proj.weight"].T


# -- LlamaGen hidden states ------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["c2i", "t2i"])
def test_hidden_states_are_the_final_norm_output_and_change_no_logits(model_type):
    model = tiny_model(model_type)
    conditioning, tokens = tiny_conditioning(model), tiny_tokens(model)
    normed = []
    model.norm.register_forward_hook(lambda module, inputs, output: normed.append(output))
    plain = model.start(conditioning, cfg=True, max_window=3)
    assert plain.first.hidden is None and plain.prefix_hidden is None
    session = model.start(conditioning, cfg=True, max_window=3, hidden=True)
    C = model.cfg.cls_token_num
    assert session.prefix_hidden.shape == (4, C, WIDTH) and torch.equal(session.prefix_hidden, normed[-1])
    assert torch.equal(session.first.hidden, normed[-1][:, -1:])
    assert torch.equal(session.first.cond, plain.first.cond) and torch.equal(session.first.uncond, plain.first.uncond)

    window, start = tokens[:, :3], torch.tensor([0, 5])
    expected = plain.forward(window, start)
    out = session.forward(window, start)
    assert out.hidden.shape == (4, 3, WIDTH) and torch.equal(out.hidden, normed[-1])
    assert torch.equal(out.cond, expected.cond) and torch.equal(out.uncond, expected.uncond)

    teacher = model.training_hidden(conditioning, tokens)
    assert teacher.shape == (2, C + model.cfg.num_tokens - 1, WIDTH)
    assert_close(session.first.hidden[:2, 0], teacher[:, C - 1], atol=1e-5, rtol=1e-5)
    assert_close(model.output(teacher[:, C - 1 :]).float(), model.training_logits(conditioning, tokens))
    # dropped rows see what CFG's uncond rows see, padded caption slots included (a drafter replays them)
    dropped = model.training_hidden(conditioning, tokens, drop=torch.tensor([True, False]))
    uncond = model.training_hidden(conditioning, tokens, drop=torch.ones(2, dtype=torch.bool))
    assert_close(uncond[:, :C], session.prefix_hidden[2:], atol=1e-5, rtol=1e-5)
    null = model.training_hidden(null_conditioning(model, conditioning), tokens)
    assert_close(uncond[:, C - 1 :], null[:, C - 1 :])
    assert_close(dropped[0], uncond[0])
    assert_close(dropped[1], teacher[1])
    assert (dropped[0] - teacher[0]).abs().max() > 1e-3


# -- the EAGLE session -----------------------------------------------------------------------------


@pytest.mark.parametrize("model_type,fc_bias,qkv_bias", [("c2i", True, False), ("t2i", False, True)])
def test_session_matches_cache_free_reference(tmp_path, model_type, fc_bias, qkv_bias):
    """Rows advance by different amounts, the target's windows carry rejected junk, each iteration drafts
    two steps from the drafter's own features; every prediction of a real position (cond and uncond rows)
    equals the reference over the whole prefix."""
    target = tiny_model(model_type)
    sd = eagle_weights(fc_bias=fc_bias, qkv_bias=qkv_bias)
    config = eagle_config(input_type=model_type, bias=fc_bias, qkv_bias=qkv_bias)
    drafter = load_drafter(write_drafter(tmp_path / "d", sd, config), target)
    conditioning, tokens = tiny_conditioning(target), tiny_tokens(target)
    (B, N), W, head = tokens.shape, 4, target.output.weight.T
    hidden = torch.cat([target.training_hidden(conditioning, tokens, drop=torch.tensor([False, False])),
                        target.training_hidden(conditioning, tokens, drop=torch.tensor([True, True]))])
    prefix = hidden.shape[1] - N  # replayed conditioning rows (C - 1)
    ids = torch.cat([torch.zeros(B, prefix, dtype=torch.long), tokens], 1).repeat(2, 1)

    def reference(row, length, extra_ids=(), extra_features=()):
        """Features of row ``row``'s first ``length`` rows, then drafted rows fed their own features."""
        row_ids = torch.cat([ids[row, :length], torch.tensor(extra_ids, dtype=torch.long)])
        row_hidden = torch.cat([hidden[row, :length], *[f[None] for f in extra_features]])
        return reference_features(sd, config, target.grid, row_ids, row_hidden, prefix)

    session = target.start(conditioning, cfg=True, max_window=W, hidden=True)
    draft_session = drafter.start(conditioning, cfg=True, max_window=W, target_session=session)
    junk = torch.Generator().manual_seed(7)
    n, out, start = torch.ones(B, dtype=torch.long), session.first, torch.full((B,), -1)
    accept_cycles, checked, iteration = [(1, 3, 0, 2), (3, 0, 2, 1)], 0, 0
    while n.min() < N:
        fixed = torch.arange(N + W + 1) < n[:, None]
        garbage = torch.randint(0, VOCAB, fixed.shape, generator=junk)
        seq = torch.where(fixed, torch.cat([tokens, tokens[:, : W + 1]], 1), garbage)
        drafted = draft_session.catch_up(seq, n, out, start)
        drafts = torch.randint(0, VOCAB, (B, 2), generator=junk)
        steps = [draft_session.step(drafts[:, :1], n), draft_session.step(drafts[:, 1:], n + 1)]
        for row in range(2 * B):
            b, half = row % B, "cond" if row < B else "uncond"
            if n[b] + 1 >= N:
                continue
            length = prefix + int(n[b])
            caught_up = reference(row, length)[-1]
            assert_close(getattr(drafted, half)[b, 0], caught_up @ head, atol=1e-4, rtol=1e-4)
            step1 = reference(row, length, drafts[b, :1].tolist(), [caught_up])[-1]
            step2 = reference(row, length, drafts[b].tolist(), [caught_up, step1])[-1]
            # fed back unnormalised, the drafter's own features grow fp32 rounding along the chain
            assert_close(getattr(steps[0], half)[b, 0], step1 @ head, atol=1e-3, rtol=1e-3)
            assert_close(getattr(steps[1], half)[b, 0], step2 @ head, atol=1e-3, rtol=1e-3)
            checked += 1

        accepts = torch.tensor([cycle[iteration % len(cycle)] for cycle in accept_cycles])
        window = torch.randint(0, VOCAB, (B, W), generator=junk)
        for b in range(B):
            real = tokens[b, n[b] - 1 : n[b] + accepts[b]]
            window[b, : len(real)] = real
        out, start = session.forward(window, n - 1), n - 1
        n = torch.minimum(n + accepts + 1, torch.tensor(N))
        iteration += 1
    assert checked >= 16


def test_session_needs_target_hidden_states(tmp_path):
    target = tiny_model()
    drafter = load_drafter(write_drafter(tmp_path / "d", eagle_weights(), eagle_config()), target)
    conditioning = tiny_conditioning(target)
    session = target.start(conditioning, cfg=False, max_window=3)
    with pytest.raises(FastARError, match="hidden=True"):
        drafter.start(conditioning, cfg=False, max_window=3, target_session=session)


# -- loading -------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,weights_file", [("bin", "pytorch_model.bin"), ("safetensors", "model.safetensors")])
def test_loads_released_folders_and_files_beside_their_config(tmp_path, fmt, weights_file):
    target = tiny_model()
    sd = eagle_weights(qkv_bias=True)
    folder = write_drafter(tmp_path / "d", sd, eagle_config(qkv_bias=True), fmt)
    for path in (folder, folder / weights_file):
        drafter = load_drafter(path, target)
        assert isinstance(drafter, EagleDrafter) and drafter.needs_target_hidden and drafter.target is target
        loaded = parted_state_dict(drafter.head)  # the release's layout
        assert loaded.keys() == sd.keys() and all(torch.equal(loaded[k], sd[k]) for k in sd)
        assert not drafter.head.training and not any(p.requires_grad for p in drafter.head.parameters())


def test_a_drafter_chosen_as_the_model_says_where_it_belongs(tmp_path):
    from fastar.model_loaders import load_ar_model

    folder = write_drafter(tmp_path / "d", eagle_weights(), eagle_config())
    with pytest.raises(FastARError, match="EAGLE-style drafter.*load it as a drafter"):
        load_ar_model(folder)


def test_small_ar_checkpoint_loads_as_ar_drafter(tmp_path):
    small = tiny_model(n_layer=1, dim=16, ffn_hidden=24)
    drafter = load_drafter(save_ar(tmp_path / "small.safetensors", small), tiny_model())
    assert isinstance(drafter, SmallARDrafter) and not drafter.needs_target_hidden
    assert drafter.model.cfg == small.cfg


def save_ar(path, model):
    save_file(parted_state_dict(model), str(path), metadata={"fastar_config": json.dumps(dataclasses.asdict(model.cfg))})
    return path


EAGLE_REFUSALS = {
    "vocabulary": (dict(vocab=60), eagle_config(vocab=60), ["60 codes", "has 50", "VQ tokenizer", "train-drafter"]),
    "width": (dict(width=48), eagle_config(width=48), ["width 48", "32 wide", "model size"]),
    "kind": ({}, eagle_config(input_type="t2i"), ["text-to-image model", "class-to-image", "target's kind"]),
    "grid": ({}, eagle_config(fastar={"grid": [5, 5]}), ["5x5", "runs 4x4", "resolution"]),
    "layers": ({}, eagle_config(num_hidden_layers=2), ["2-layer", "one SiLU layer"]),
    "config vs weights": ({}, eagle_config(intermediate_size=64), ["does not fit", "wrong shapes", "mlp.gate_proj"]),
}


@pytest.mark.parametrize("case", EAGLE_REFUSALS)
def test_eagle_mismatches_are_refused(tmp_path, case):
    weight_args, config, fragments = EAGLE_REFUSALS[case]
    folder = write_drafter(tmp_path / "d", eagle_weights(**weight_args), config)
    with pytest.raises(FastARError) as e:
        load_drafter(folder, tiny_model())
    assert all(f in str(e.value) for f in fragments), str(e.value)


def test_files_that_are_no_drafter_are_refused(tmp_path):
    target = tiny_model()
    vq = {"quantize.embedding.weight": torch.randn(8, 4),
          "decoder.conv_blocks.0.res.0.conv1.weight": torch.randn(2, 2, 1, 1)}
    save_file(vq, str(tmp_path / "vq.safetensors"))
    save_file({"foo.weight": torch.randn(2)}, str(tmp_path / "other.safetensors"))
    cases = {
        tmp_path / "vq.safetensors": ["a VQ tokenizer", "not a drafter"],
        tmp_path / "other.safetensors": ["no model FastAR knows", "foo.weight", "not a drafter"],
        write_drafter(tmp_path / "bare", eagle_weights(), None): ["no config.json", "keep the drafter's folder whole"],
        tmp_path / "missing": ["no checkpoint at"],
    }
    truncated = write_drafter(tmp_path / "cut", eagle_weights(), eagle_config()) / "model.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:300])
    cases[truncated.parent] = ["truncated or corrupt"]
    for path, fragments in cases.items():
        with pytest.raises(FastARError) as e:
            load_drafter(path, target)
        assert all(f in str(e.value) for f in fragments), str(e.value)


@pytest.mark.parametrize("name, what", [("demo_mar.safetensors", "a MAR model"),
                                        ("demo_dd.safetensors", "a Distilled Decoding student"),
                                        ("demo_var.safetensors", "a VAR model")])
def test_a_model_of_another_kind_is_refused_as_drafter_naming_both_kinds(name, what):
    from fastar.model_loaders.shared.demo import DEMO_DIR

    with pytest.raises(FastARError) as e:
        load_drafter(DEMO_DIR / name, tiny_model())
    assert f"is {what}, and the target is a LlamaGen GPT" in str(e.value), str(e.value)
    assert "EAGLE drafter folder or a smaller LlamaGen GPT" in str(e.value)


AR_REFUSALS = {
    "vocabulary": (dict(vocab_size=60), {}, ["draws 60 codes", "draws 50", "VQ tokenizer"]),
    "grid": (dict(grid=(5, 5)), {}, ["5x5", "4x4", "image size"]),
    "classes": (dict(num_classes=12), {}, ["12 classes", "target model 10"]),
    "kind": (dict(model_type="t2i"), {}, ["text-to-image model", "class-to-image"]),
    "caption": (dict(model_type="t2i", caption_dim=16), dict(model_type="t2i"),
                ["width 16", "width 24", "text encoder"]),
}


@pytest.mark.parametrize("case", AR_REFUSALS)
def test_ar_drafter_mismatches_are_refused(tmp_path, case):
    drafter_args, target_args, fragments = AR_REFUSALS[case]
    path = save_ar(tmp_path / "small.safetensors", tiny_model(**{"n_layer": 1, **drafter_args}))
    with pytest.raises(FastARError) as e:
        load_drafter(path, tiny_model(**target_args))
    assert all(f in str(e.value) for f in fragments), str(e.value)


def test_save_writes_the_released_layout_and_round_trips(tmp_path):
    target = tiny_model()
    sd, config = eagle_weights(), eagle_config(fastar={"grid": [4, 4]})
    drafter = load_drafter(write_drafter(tmp_path / "a", sd, config), target)
    save_eagle_drafter(drafter, tmp_path / "b")
    saved = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert saved.keys() == sd.keys() and all(t.dtype == torch.float16 for t in saved.values())
    written = json.loads((tmp_path / "b" / "config.json").read_text())
    assert {k: written[k] for k in config} == {**config, "fastar": {"grid": [4, 4]}}
    again = load_drafter(tmp_path / "b", target)
    assert again.head.cfg == drafter.head.cfg
    for key, tensor in sd.items():
        assert torch.equal(parted_state_dict(again.head)[key], tensor.half().float()), key


# -- the trainer -----------------------------------------------------------------------------------


def train_drafter(*args, cwd):
    return subprocess.run([sys.executable, "-m", "fastar", "train-drafter", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("kind,out,extra", [("eagle", "drafter", []),
                                            ("ar", "small.safetensors", ["--dim", 16, "--layers", 1, "--heads", 2])])
def test_train_drafter_command_trains_saves_and_reports(tmp_path, kind, out, extra):
    target = tiny_model()
    save_ar(tmp_path / "target.safetensors", target)
    r = train_drafter("--target", tmp_path / "target.safetensors", "--kind", kind, "--out", tmp_path / out,
                      "--samples", 4, "--val-samples", 2, "--steps", 3, "--batch", 2, "--device", "cpu",
                      "--log-every", 1, "--cache-dir", tmp_path / "cache", *extra, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "step 3/3 loss" in r.stdout and "held-out agreement with the target" in r.stdout
    drafter = load_drafter(tmp_path / out, target)
    assert isinstance(drafter, EagleDrafter if kind == "eagle" else SmallARDrafter)
    assert list((tmp_path / "cache").glob("drafter_samples_*.pt"))  # samples kept for a re-run
