"""VAR-DD students (models.md and decoders.md, "DD"): the release's math written out here and compared on a tiny
random student (extra leading scale, data/noise embedding added at the input, between each block's attention and
FFN and before the heads, the mask that hides a scale's other tokens, the continuous head's shift-then-scale), the
release's checkpoint layout loads, and the DD sampler runs it with the VQVAE accumulating its output."""
import json

import torch
import torch.nn.functional as F

from fastar.model_loaders import load_ar_model
from fastar.model_loaders.shared.protocol import ClassConditioning
from fastar.model_loaders.var.dd_student import VARDDConfig, VARDDStudent, dd_mask
from fastar.samplers.decoders import decode_distilled
from fastar.samplers.few_step_loops.distilled import DDSettings
from tiny_var import PATCH_NUMS, randomised, tiny_vqvae

TOKENS = sum(p * p for p in PATCH_NUMS)  # 30


def tiny_student(seed=5) -> VARDDStudent:
    cfg = VARDDConfig(depth=2, dim=32, n_head=2, vocab_size=16, channels=4, num_classes=5, patch_nums=PATCH_NUMS,
                      t2=5, split=5)
    return randomised(VARDDStudent(cfg), seed)


def reference_predict(student, x, labels, t):
    """The student's forward from the release's rules, step by step."""
    C = student.cfg.dim
    cond = student.class_emb(labels)
    h = torch.cat([cond[:, None] + student.pos_start, student.word_embed(x)], dim=1)
    levels = torch.tensor([0] + [1 + k for k, p in enumerate(PATCH_NUMS) for _ in range(p * p)])
    h = h + student.lvl_embed(levels) + student.pos_1LC
    n_d = student.n_d_embed((torch.arange(TOKENS + 1) < 1 + t).long())[None]
    h = h + n_d
    mask = (levels[:, None] > levels[None, :]) | torch.eye(TOKENS + 1, dtype=torch.bool)
    ln = lambda t_: F.layer_norm(t_, (C,), eps=1e-6)  # noqa: E731
    for block, layerwise in zip(student.blocks, student.layerwise_n_d_embed):
        g1, g2, s1, s2, b1, b2 = block.ada_lin(cond).view(-1, 1, 6, C).unbind(2)
        h = h + block.attn(ln(h) * (1 + s1) + b1, mask, None) * g1
        h = h + layerwise(n_d)
        h = h + block.ffn(ln(h) * (1 + s2) + b2) * g2
    h = h + student.layerwise_n_d_embed[-1](n_d)
    scale, shift = student.head_nm.ada_lin(cond).view(-1, 1, 2, C).unbind(2)
    logits = student.head(ln(h) * (1 + scale) + shift)[:, 1:]
    table = student.final_layer_conti.scale_shift_table
    conti = student.final_layer_conti.linear(ln(h) * (1 + table[1] + cond[:, None]) + table[0] + cond[:, None])[:, 1:]
    return conti, logits


def test_student_follows_the_release_math():
    student = tiny_student()
    g = torch.Generator().manual_seed(0)
    x, labels = torch.randn(2, TOKENS, 4, generator=g), torch.tensor([1, 3])
    with torch.no_grad():
        for t in (0, 5):
            conti, logits = student.predict(x, labels, t)
            want_conti, want_logits = reference_predict(student, x, labels, t)
            torch.testing.assert_close(conti, want_conti, rtol=1e-3, atol=1e-4)
            torch.testing.assert_close(logits, want_logits, rtol=1e-3, atol=1e-4)


def test_a_token_sees_earlier_scales_and_itself_not_its_own_scales_others():
    mask = dd_mask((1, *PATCH_NUMS))
    assert mask.shape == (31, 31) and mask[0].sum() == 1  # the class slot sees only itself
    assert mask[2, 1] and not mask[2, 3] and mask[2, 2]  # scale 2 (slots 2..5): earlier levels and itself
    student = tiny_student()
    g = torch.Generator().manual_seed(1)
    x, labels = torch.randn(1, TOKENS, 4, generator=g), torch.tensor([2])
    with torch.no_grad():
        base, _ = student.predict(x, labels, 0)
        x[0, 6] += 1.0  # token 6: the second of scale 3 (tokens 5..13)
        moved, _ = student.predict(x, labels, 0)
    changed = (moved - base).abs().amax(-1)[0] > 1e-6
    assert changed[6] and not changed[:6].any() and not changed[7:14].any() and changed[14:].all()


def test_release_layout_loads_and_the_dd_sampler_runs_it_through_the_vqvae(tmp_path):
    student, vqvae = tiny_student(), tiny_vqvae()
    sd = {k: v for k, v in student.state_dict().items() if k not in ("lvl_1L", "attn_bias_for_masking")}
    torch.save({"trainer": {"ema_parameters": sd, "var_wo_ddp": {k: torch.zeros_like(v) for k, v in sd.items()}}},
               tmp_path / "var-tiny.pth")
    (tmp_path / "var-tiny.json").write_text(json.dumps({"patch_nums": list(PATCH_NUMS), "split_t": 2}))
    loaded = load_ar_model(tmp_path / "var-tiny.pth")
    assert isinstance(loaded, VARDDStudent) and (loaded.cfg.t2, loaded.cfg.split) == (5, 5)  # scales 1 and 2
    assert torch.equal(loaded.attn_bias_for_masking, student.attn_bias_for_masking)
    conditioning = ClassConditioning(torch.tensor([0, 4]))
    out, stats = decode_distilled(loaded, conditioning, DDSettings(steps=2), seed=3, codebook=vqvae.codebook())
    assert out.shape == (2, TOKENS, 4) and stats.target_forwards == 2
    first = torch.cdist(out[:, :5].flatten(0, 1), vqvae.codebook()).min(-1).values
    assert first.max() < 1e-5  # before the split: code vectors
    with torch.no_grad():
        images = vqvae.decode(out)
        codes = [torch.cdist(part.flatten(0, 1), vqvae.codebook()).argmin(-1).view(2, p, p)
                 for part, p in zip(out.split([p * p for p in PATCH_NUMS], dim=1), PATCH_NUMS)]
    assert images.shape == (2, 3, 16, 16)
    _, f_hat_of_codes = vqvae.teacher_inputs(codes, PATCH_NUMS)
    late = vqvae.sequence_to_f_hat(out) - f_hat_of_codes
    assert late.abs().max() > 1e-3  # the continuous outputs after the split are not snapped to codes


def test_cli_runs_a_var_dd_student_and_writes_f_hat(tmp_path):
    import subprocess
    import sys

    import numpy as np

    from tiny_var import write_release_files

    write_release_files(tmp_path)
    torch.save({"trainer": {"ema_parameters": tiny_student().state_dict()}}, tmp_path / "var-tiny.pth")
    (tmp_path / "var-tiny.json").write_text(json.dumps({"patch_nums": list(PATCH_NUMS), "split_t": 2}))
    run = lambda *a: subprocess.run([sys.executable, "-m", "fastar", "generate", "--model", tmp_path / "var-tiny.pth",  # noqa: E731
                                     "--vq", tmp_path / "vae_var_tiny.pth", "--classes", "1,2", "--quiet", *map(str, a)],
                                    cwd=tmp_path, capture_output=True, text=True, timeout=600)
    r = run("--dd-steps", "2", "--out", tmp_path / "a.png", "--latents-out", tmp_path / "a.npy")
    assert r.returncode == 0, r.stderr
    assert "dd: 2 images of 30 tokens in 2 forwards" in r.stdout and (tmp_path / "a_1.png").exists()
    assert np.load(tmp_path / "a.npy").shape == (2, 4, 4, 4)  # f_hat
    r = run("--dd-steps", "2", "--tokens-out", tmp_path / "t.json")
    assert r.returncode == 0, r.stderr
    saved = json.loads((tmp_path / "t.json").read_text())
    assert saved["scales"] == [[p, p] for p in PATCH_NUMS] and saved["grid"] == [4, 4] and len(saved["tokens"]) == 2
    assert [len(scale) for scale in saved["tokens"][0]] == [p * p for p in PATCH_NUMS]
    # each scale's token map: the nearest code of each vector the student wrote (its greedy codes before the split)
    from fastar.model_loaders import load_image_decoder

    vectors = load_image_decoder(tmp_path / "vae_var_tiny.pth").codebook()
    out, _ = decode_distilled(load_ar_model(tmp_path / "var-tiny.pth"), ClassConditioning(torch.tensor([1, 2])),
                              DDSettings(steps=2), seed=0, codebook=vectors)
    nearest = torch.cdist(out.flatten(0, 1), vectors).argmin(-1).view(2, -1)
    assert [sum(row, []) for row in saved["tokens"]] == nearest.tolist()


def test_a_student_of_no_released_depth_without_split_t_runs_with_dd_split_and_t2(tmp_path):
    """Without split_t in NAME.json the student still loads; the DD run says to give --dd-split/--dd-t2 (or
    split_t), and following either gives the same image."""
    import subprocess
    import sys

    import numpy as np

    from tiny_var import write_release_files

    write_release_files(tmp_path)
    torch.save({"trainer": {"ema_parameters": tiny_student().state_dict()}}, tmp_path / "var-tiny.pth")
    (tmp_path / "var-tiny.json").write_text(json.dumps({"patch_nums": list(PATCH_NUMS)}))
    run = lambda *a: subprocess.run([sys.executable, "-m", "fastar", "generate", "--model", tmp_path / "var-tiny.pth",  # noqa: E731
                                     "--vq", tmp_path / "vae_var_tiny.pth", "--classes", "1,2", "--quiet",
                                     "--dd-steps", "2", *map(str, a)],
                                    cwd=tmp_path, capture_output=True, text=True, timeout=600)
    r = run("--latents-out", tmp_path / "none.npy")
    assert r.returncode == 2, r.stderr
    assert "var-tiny.pth is a depth-2 VAR-DD student, none of the released sizes (16, 20, 24), and var-tiny.json " \
        "beside it gives no split_t: give the split in tokens (--dd-split, and --dd-t2 for two steps" in r.stderr
    r = run("--dd-split", 5, "--dd-t2", 5, "--latents-out", tmp_path / "flags.npy")
    assert r.returncode == 0, r.stderr
    (tmp_path / "var-tiny.json").write_text(json.dumps({"patch_nums": list(PATCH_NUMS), "split_t": 2}))
    r = run("--latents-out", tmp_path / "split_t.npy")
    assert r.returncode == 0, r.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "flags.npy"), np.load(tmp_path / "split_t.npy"))


def test_distill_dd_makes_a_var_dd_student_from_a_var_teacher(tmp_path):
    """A whole tiny run: the pairs are the teacher's scale-by-scale flow map of their noise, the student starts as
    the teacher (its first token's slot and level copied from the class slot's) and loads as a VAR-DD student."""
    import subprocess
    import sys

    from fastar.model_loaders import load_image_decoder
    from fastar.samplers.few_step_loops.flow_map import NoiseToCode
    from fastar.samplers.few_step_loops.next_scale import RecordedDraw, next_scale_decode
    from fastar.commands.dd_pairs import PairSettings, load_pairs
    from fastar.commands.distill_dd import var_student_from_teacher
    from tiny_var import write_release_files

    write_release_files(tmp_path)
    args = ["distill-dd", "--teacher", tmp_path / "var_tiny.pth", "--vq", tmp_path / "vae_var_tiny.pth", "--classes",
            "0,3", "--per-class", 4, "--shard-size", 4, "--cfg", 1.5, "--steps", 3, "--batch", 2, "--data",
            tmp_path / "pairs", "--out", tmp_path / "student.safetensors", "--t2", 5]
    r = subprocess.run([sys.executable, "-m", "fastar", *map(str, args)], cwd=tmp_path, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    teacher, vqvae = load_ar_model(tmp_path / "var_tiny.pth"), load_image_decoder(tmp_path / "vae_var_tiny.pth")
    pairs = load_pairs(tmp_path / "pairs")
    assert pairs["noise"].shape == (8, TOKENS, 4)
    draw = RecordedDraw(NoiseToCode(pairs["noise"][:4], vqvae.codebook().float()).span)
    next_scale_decode(teacher, vqvae, ClassConditioning(pairs["labels"][:4]), PairSettings(cfg_scale=1.5).sampling(),
                      generator=None, draw=draw)
    assert torch.equal(draw.codes, pairs["tokens"][:4])
    student = load_ar_model(tmp_path / "student.safetensors")
    assert isinstance(student, VARDDStudent) and (student.cfg.t2, student.cfg.split) == (5, 5)
    start = var_student_from_teacher(teacher, vqvae.codebook(), 5, 5)
    torch.testing.assert_close(start.pos_1LC[:, 1:], teacher.pos_1LC)
    torch.testing.assert_close(start.pos_1LC[:, 0], teacher.pos_1LC[:, 0])
    torch.testing.assert_close(start.blocks[1].ffn.fc2.weight, teacher.blocks[1].ffn.fc2.weight)
    assert start.final_layer_conti.linear.weight.abs().max() == 0 and start.n_d_embed.weight.abs().max() == 0
    r = subprocess.run([sys.executable, "-m", "fastar", *map(str, args[:-2]), "--t2", "6"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "t2 is one of [1, 5, 14] tokens" in r.stderr
