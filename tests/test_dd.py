"""Distilled Decoding students (LlamaGen-DD format) and the dd sampler (decoders.md and models.md, "DD").

The student's math is pinned by its consequences on a tiny random student: which positions count as data,
which output slot predicts which token, which hidden state the continuous head reads. The sampler is pinned
on the released rules: greedy codes before the split, raw continuous outputs after it, the same noise at
both steps, positions before t2 kept. Files in the released layout (``{"ema": ..., "model": ...}``) load.
"""
import json
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from fastar.errors import FastARError
from fastar.model_loaders import load_ar_model, load_image_decoder
from fastar.model_loaders.dd.student import DDStudent, DDStudentConfig
from fastar.model_loaders.shared.demo import DEMO_VQ
from fastar.model_loaders.shared.joined import parted_state_dict
from fastar.model_loaders.shared.protocol import ClassConditioning
from fastar.samplers.decoders import decode_distilled
from fastar.samplers.few_step_loops.distilled import DDSettings, dd_decode
from fastar.samplers.token_loops.jacobi import ar_decode
from fastar.samplers.processing import SamplingSettings
from tiny_llamagen import tiny_model

GRID, CODES, WIDTH = (4, 4), 24, 8


def tiny_student(seed=0, grid=GRID, vocab=CODES, classes=10, split=6, t2=5) -> DDStudent:
    cfg = DDStudentConfig(dim=32, n_layer=2, n_head=4, vocab_size=vocab, grid=grid, ffn_hidden=48,
                          num_classes=classes, channels=WIDTH, split=split, t2=t2)
    student = DDStudent(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in student.state_dict().values():
            tensor.copy_(torch.randn(tensor.shape, generator=g) * 0.3)
    return student.eval()


def codebook(vocab=CODES, seed=1):
    return torch.nn.functional.normalize(torch.randn(vocab, WIDTH, generator=torch.Generator().manual_seed(seed)), dim=-1)


def inputs(batch=3, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, GRID[0] * GRID[1], WIDTH, generator=g), torch.tensor([1, 4, 9])[:batch]


def test_position_j_is_data_iff_j_below_t_and_slot_j_plus_1_predicts_token_j():
    student = tiny_student()
    x, labels = inputs()
    with torch.no_grad():
        cont5, logits5 = student.predict(x, labels, 5)
        cont6, logits6 = student.predict(x, labels, 6)
    # t = 5 -> 6 flips only the embedding of image position 5 (slot 6); causal attention and the unshifted
    # output then change tokens 5.. and leave tokens 0..4 alone
    assert torch.equal(logits5[:, :5], logits6[:, :5]) and torch.equal(cont5[:, :5], cont6[:, :5])
    assert not torch.allclose(logits5[:, 5], logits6[:, 5]) and not torch.allclose(cont5[:, 5], cont6[:, 5])


def test_heads_read_the_hidden_state_as_released():
    """Logits from the final RMSNorm; the continuous head from the hidden state before it (LayerNorm
    without affine, eps 1e-6, modulated by the raw class embedding)."""
    student = tiny_student()
    x, labels = inputs()
    seen = {}
    student.layers[-1].register_forward_hook(lambda _m, _i, out: seen.update(h=out))
    with torch.no_grad():
        cont, logits = student.predict(x, labels, 3)
        h, c = seen["h"][:, 1:], student.cls_embedding.embedding_table.weight[labels][:, None]
        table, head = student.final_layer_conti.scale_shift_table, student.final_layer_conti.linear
        normed = (h - h.mean(-1, keepdim=True)) / torch.sqrt(h.var(-1, unbiased=False, keepdim=True) + 1e-6)
        want_cont = head(normed * (1 + table[1] + c) + table[0] + c)
        want_logits = student.output(student.norm(h))
    torch.testing.assert_close(cont, want_cont)
    torch.testing.assert_close(logits, want_logits)


def test_one_step_takes_greedy_codes_before_the_split_and_raw_outputs_after():
    student, book = tiny_student(split=6), codebook()
    noise, labels = inputs()
    latents, stats = dd_decode(student, labels, noise, book, DDSettings(steps=1))
    with torch.no_grad():
        cont, logits = student.predict(noise, labels, 0)
    torch.testing.assert_close(latents[:, :6], book[logits[:, :6].argmax(-1)])
    torch.testing.assert_close(latents[:, 6:], cont[:, 6:])
    assert stats.target_forwards == 1 and stats.step_compression == 16


def test_two_steps_feed_back_the_first_and_reuse_the_same_noise():
    student, book = tiny_student(split=6, t2=5), codebook()
    noise, labels = inputs()
    fed = []
    predict = student.predict
    student.predict = lambda x, y, t: fed.append((x.clone(), t)) or predict(x, y, t)
    first, _ = dd_decode(student, labels, noise, book, DDSettings(steps=1))
    fed.clear()
    second, stats = dd_decode(student, labels, noise, book, DDSettings(steps=2))
    assert [t for _, t in fed] == [0, 5] and stats.target_forwards == 2
    step2_input = fed[1][0]
    torch.testing.assert_close(step2_input[:, :5], first[:, :5])  # data: the first step's output, as it was
    torch.testing.assert_close(step2_input[:, 5:], noise[:, 5:])  # the same noise, not a fresh draw
    torch.testing.assert_close(second[:, :5], first[:, :5])  # kept positions stay
    with torch.no_grad():
        cont, logits = predict(step2_input, labels, 5)
    torch.testing.assert_close(second[:, 5:6], book[logits[:, 5:6].argmax(-1)])
    torch.testing.assert_close(second[:, 6:], cont[:, 6:])


def test_kept_continuous_positions_stay_continuous_when_the_split_is_below_t2():
    student, book = tiny_student(split=2, t2=5), codebook()
    noise, labels = inputs()
    first, _ = dd_decode(student, labels, noise, book, DDSettings(steps=1))
    second, _ = dd_decode(student, labels, noise, book, DDSettings(steps=2))
    torch.testing.assert_close(second[:, :5], first[:, :5])
    assert torch.cdist(second[:, 2:5].flatten(0, 1), book).min(-1).values.min() > 1e-3  # never quantised


def test_seeded_runs_repeat_and_rows_are_independent():
    student, book = tiny_student(), codebook()
    conditioning = ClassConditioning(torch.tensor([2, 2, 5]))
    a, _ = decode_distilled(student, conditioning, DDSettings(steps=2), seed=7, codebook=book)
    b, _ = decode_distilled(student, conditioning, DDSettings(steps=2), seed=7, codebook=book)
    c, _ = decode_distilled(student, conditioning, DDSettings(steps=2), seed=8, codebook=book)
    assert torch.equal(a, b) and not torch.allclose(a, c)
    assert not torch.allclose(a[0], a[1])  # same class, own noise per row
    alone, _ = decode_distilled(student, ClassConditioning(torch.tensor([5])), DDSettings(steps=2), seed=0,
                                codebook=book, noise=torch.from_numpy(np.zeros((1, 16, WIDTH), np.float32)))
    batched, _ = decode_distilled(student, ClassConditioning(torch.tensor([5, 5])), DDSettings(steps=2), seed=0,
                                  codebook=book, noise=torch.zeros(2, 16, WIDTH))
    torch.testing.assert_close(alone[0], batched[1])


def test_bad_settings_and_inputs_are_refused():
    student, book = tiny_student(), codebook()
    conditioning = ClassConditioning(torch.tensor([1]))
    run = lambda settings=DDSettings(), **kw: decode_distilled(student, conditioning, settings, seed=0,  # noqa: E731
                                                               **{"codebook": book, **kw})
    with pytest.raises(FastARError, match="1 or 2 steps"):
        run(DDSettings(steps=3))
    with pytest.raises(FastARError, match="t2 = 16 must lie in 1..15"):
        run(DDSettings(steps=2, t2=16))
    with pytest.raises(FastARError, match="needs the VQ decoder's codebook"):
        run(codebook=None)
    with pytest.raises(FastARError, match="has 30 codes but the AR model predicts 24"):
        run(codebook=codebook(vocab=30))
    with pytest.raises(FastARError, match=r"the noise is \[1, 9, 8\]"):
        run(noise=torch.zeros(1, 9, WIDTH))
    with pytest.raises(FastARError, match="the noise has 2 rows but 1 images"):
        run(noise=torch.zeros(2, 16, WIDTH))


def released_layout(student: DDStudent, path, ema_scale=1.0):
    """A file as microsoft/distilled_decoding ships it: EMA and raw weights, no sizes, no FastAR metadata."""
    ema = {k: v * ema_scale for k, v in parted_state_dict(student).items()}
    raw = {k: torch.zeros_like(v) for k, v in ema.items()}
    torch.save({"model": raw, "ema": ema, "steps": 1000}, path)


def test_released_layout_loads_the_ema_weights(tmp_path):
    student = tiny_student(grid=(16, 16))
    released_layout(student, tmp_path / "llamagen-tiny.pt")
    (tmp_path / "llamagen-tiny.json").write_text(json.dumps({"num_attention_heads": 4, "split_t": 7}))
    loaded = load_ar_model(tmp_path / "llamagen-tiny.pt")
    assert isinstance(loaded, DDStudent) and loaded.kind == "few-step"
    assert loaded.grid == (16, 16) and loaded.cfg.split == 7 and loaded.cfg.channels == WIDTH
    noise, labels = torch.randn(2, 256, WIDTH), torch.tensor([0, 3])
    with torch.no_grad():
        for t in (0, 80):
            for got, want in zip(loaded.predict(noise, labels, t), student.predict(noise, labels, t)):
                torch.testing.assert_close(got, want)


def test_unknown_size_without_a_split_needs_one_from_the_run_and_a_plain_gpt_is_not_a_student(tmp_path):
    """A student of no released size whose files do not say its split loads without a word (no guess); a run
    must give the split (--dd-split), and one that does draws without warnings."""
    released_layout(tiny_student(grid=(16, 16)), tmp_path / "s.pt")
    (tmp_path / "s.json").write_text(json.dumps({"num_attention_heads": 4}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        student = load_ar_model(tmp_path / "s.pt")
        assert student.cfg.split is None
        assert DDSettings(steps=1, split=40).resolve(student).split == 40
    with pytest.raises(FastARError, match="none of the released sizes, and nothing beside it says its split point: "
                                          "give the split in tokens"):
        DDSettings(steps=1).resolve(student)
    sd = parted_state_dict(tiny_student(grid=(16, 16)))
    del sd["n_d_embed.weight"]
    torch.save({"ema": sd}, tmp_path / "cut.pt")
    with pytest.raises(FastARError):
        load_ar_model(tmp_path / "cut.pt")


def demo_codes() -> int:
    """The bundled demo VQ's code count, which a student it decodes for predicts."""
    return load_image_decoder(DEMO_VQ).cfg.codebook_size


def fastar(*args, cwd):
    return subprocess.run([sys.executable, "-m", "fastar", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=600)


def test_cli_runs_a_student_reproduces_it_from_its_noise_and_refuses_cfg(tmp_path):
    student = tiny_student(grid=(16, 16), vocab=demo_codes(), classes=8, split=100, t2=80)
    released_layout(student, tmp_path / "student.pt")
    (tmp_path / "student.json").write_text(json.dumps({"num_attention_heads": 4, "split_t": 100}))
    common = ("generate", "--model", tmp_path / "student.pt", "--vq", DEMO_VQ, "--classes", "1,5", "--quiet")
    r = fastar(*common, "--dd-steps", "2", "--seed", 3, "--out", tmp_path / "a.png", "--latents-out", tmp_path / "a.npy",
               "--tokens-out", tmp_path / "a.json", "--noise-out", tmp_path / "noise.npy", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "dd: 2 images of 256 tokens in 2 forwards" in r.stdout
    assert (tmp_path / "a_0.png").exists() and (tmp_path / "a_1.png").exists()
    assert f"wrote {tmp_path / 'noise.npy'} (the noise [2, 256, {WIDTH}])" in r.stdout.splitlines()
    latents = np.load(tmp_path / "a.npy")
    assert latents.shape == (2, WIDTH, 16, 16) and latents.dtype == np.float32
    tokens = torch.tensor(json.loads((tmp_path / "a.json").read_text())["tokens"])
    vectors = torch.from_numpy(latents).permute(0, 2, 3, 1).reshape(-1, WIDTH)
    assert torch.equal(tokens.flatten(), torch.cdist(vectors, load_image_decoder(DEMO_VQ).codebook()).argmin(-1))
    r = fastar(*common, "--dd-steps", "2", "--noise-in", tmp_path / "noise.npy", "--latents-out", tmp_path / "b.npy",
               cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "b.npy"), latents)
    r = fastar(*common, "--cfg", "3", cwd=tmp_path)
    assert r.returncode == 2 and "--cfg, --temperature, --top-k and --top-p do not apply" in r.stderr
    r = fastar("decode", "--vq", DEMO_VQ, "--latents-in", tmp_path / "a.npy", "--out", tmp_path / "back.png",
               cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    back, direct = (np.asarray(Image.open(tmp_path / f"{n}_1.png")).astype(int) for n in ("back", "a"))
    assert np.abs(back - direct).max() <= 1  # the same latents, up to float rounding in the decoder


def test_bench_dd_compares_the_student_with_its_teacher(tmp_path):
    student = tiny_student(grid=(16, 16), vocab=demo_codes(), classes=8, split=100, t2=80)
    released_layout(student, tmp_path / "student.pt")
    (tmp_path / "student.json").write_text(json.dumps({"num_attention_heads": 4, "split_t": 100}))
    r = fastar("bench", "--dd", "--model", tmp_path / "student.pt", "--samples", 8, "--timing-runs", 1,
               "--out", tmp_path / "bench", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "bench" / "bench_dd.json").read_text())
    rows = report["results"]
    assert list(rows) == ["ar", "fm", "dd-1", "dd-2", "dd-hybrid"] and report["cfg"] == 2.0
    assert report["dd"] == {"t2": 80, "split": 100, "regenerate": 40}
    assert rows["ar"]["forwards_per_image"] == 255 and rows["dd-1"]["forwards_per_image"] == 1
    assert rows["dd-2"]["forwards_per_image"] == 2 and rows["ar"]["latency_ratio"] == 1.0
    assert rows["dd-hybrid"]["forwards_per_image"] == 2 + 40  # the teacher samples positions 40..79
    assert rows["ar"]["frechet_vs_ar"] < 1e-6 and all(0 <= r["class_accuracy"] <= 1 for r in rows.values())
    assert "| dd-1 | 1 |" in (tmp_path / "bench" / "bench_dd.md").read_text()
    assert (tmp_path / "bench" / "pareto_dd.png").stat().st_size > 10_000


def test_the_teacher_continues_a_prefix_with_its_exact_conditional():
    """ar_decode from a fixed prefix (DD's hybrid): the later tokens follow the exact joint given the prefix."""
    from test_flow_map import MODEL as TOY, null_tv_bound, tv_distance

    rows, settings = 20000, SamplingSettings(cfg_scale=2.0, temperature=1.3, top_k=2)
    prefix = torch.tensor([[2, 0]]).expand(rows, 2)
    tokens, stats = ar_decode(TOY, ClassConditioning(torch.ones(rows, dtype=torch.long)), settings,
                              generator=torch.Generator().manual_seed(0), prefix=prefix)
    assert torch.equal(tokens[:, :2], prefix) and stats.target_forwards == 2  # the prefix read in one forward
    exact = TOY.exact_joint(1, cfg_scale=2.0, temperature=1.3, top_k=2).numpy()
    starts = np.array([seq[:2] == (2, 0) for seq in TOY.sequences()])
    given = np.where(starts, exact, 0.0) / exact[starts].sum()
    counts = np.bincount(TOY.index_of(tokens).numpy(), minlength=len(exact)).astype(float)
    assert tv_distance(counts, given) < null_tv_bound(given, rows)
    short, _ = ar_decode(TOY, ClassConditioning(torch.ones(4, dtype=torch.long)), settings,
                         generator=torch.Generator().manual_seed(0), prefix=torch.zeros(4, 1, dtype=torch.long), stop=3)
    assert short.shape == (4, 3)


def test_hybrid_lets_the_teacher_fill_positions_s_to_t2_between_the_steps():
    student, book = tiny_student(split=6, t2=5), codebook()
    teacher = tiny_model(vocab_size=CODES, grid=GRID)
    conditioning = ClassConditioning(torch.tensor([1, 4, 9]))
    fed = []
    predict = student.predict
    student.predict = lambda x, y, t: fed.append(x.clone()) or predict(x, y, t)
    noise = torch.randn(3, 16, WIDTH, generator=torch.Generator().manual_seed(3))
    _, stats = decode_distilled(student, conditioning, DDSettings(steps=2, regenerate=2), seed=0, codebook=book,
                                noise=noise, teacher=teacher, sampling=SamplingSettings(cfg_scale=1.5))
    first = dd_decode(student, conditioning.labels, noise, book, DDSettings(steps=1))[0]
    second_input = fed[1]
    kept = torch.cdist(first[:, :2].flatten(0, 1), book).argmin(-1).view(3, 2)
    torch.testing.assert_close(second_input[:, :2], book[kept])  # the first step's codes, quantised
    assert torch.cdist(second_input[:, 2:5].flatten(0, 1), book).min(-1).values.max() < 1e-6  # teacher codes
    torch.testing.assert_close(second_input[:, 5:], noise[:, 5:])
    assert stats.settings["teacher_forwards"] == 3 and stats.target_forwards == 5
    with pytest.raises(FastARError, match="not the student's"):
        decode_distilled(student, conditioning, DDSettings(steps=2, regenerate=2), seed=0, codebook=book,
                         teacher=tiny_model(vocab_size=50, grid=GRID))
    with pytest.raises(FastARError, match="give 2 steps and s in 0..4"):
        decode_distilled(student, conditioning, DDSettings(steps=2, regenerate=5), seed=0, codebook=book,
                         teacher=teacher)


def test_hybrid_settings_default_to_half_of_t2_and_are_checked():
    student = tiny_student(split=6, t2=5)
    assert DDSettings(steps=1).hybrid(student) == DDSettings(steps=2, t2=5, split=6, regenerate=2)
    assert DDSettings(t2=9, split=3).hybrid(student, 7) == DDSettings(steps=2, t2=9, split=3, regenerate=7)
    with pytest.raises(FastARError, match="s in 0..4"):
        DDSettings().hybrid(student, 5)
