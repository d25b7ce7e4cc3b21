"""distill-dd: the pairs (resumable, reproducible, refused when mixed), the student's start from the teacher,
a loss that trains what the sampler uses, and a whole tiny run end to end that saves a loadable student."""
import json
from dataclasses import replace

import pytest
import torch

from fastar.errors import FastARError
from fastar.model_loaders import load_ar_model
from fastar.model_loaders.dd.student import DDStudent, model_fingerprint
from fastar.model_loaders.shared.demo import DEMO_VQ
from fastar.model_loaders.shared.protocol import ClassConditioning
from fastar.samplers.decoders import DecoderSpec, decode, fm_decode
from fastar.commands import distill_dd
from fastar.commands.dd_pairs import PairSettings, load_pairs, make_pairs
from fastar.commands.training import save_fp16
from tiny_llamagen import tiny_model

SETTINGS = PairSettings(cfg_scale=1.5, per_class=6, shard_size=4, seed=3)


def codebook(vocab=50, width=8):
    return torch.nn.functional.normalize(torch.randn(vocab, width, generator=torch.Generator().manual_seed(4)), dim=-1)


def test_pairs_are_the_flow_map_of_their_noise_and_resume_exactly(tmp_path):
    teacher, book = tiny_model(), codebook()
    make_pairs(teacher, book, tmp_path, [2, 7], SETTINGS, quiet=True)
    shards = sorted(tmp_path.glob("pairs_*.safetensors"))
    assert len(shards) == 3  # 12 pairs in shards of 4
    pairs = load_pairs(tmp_path)
    assert pairs["noise"].shape == (12, 16, 8) and pairs["labels"].tolist() == [2, 7] * 6
    again, _ = fm_decode(teacher, ClassConditioning(pairs["labels"]), SETTINGS.sampling(), pairs["noise"], book)
    assert torch.equal(again, pairs["tokens"])
    # the seeded fm decoder draws its noise the same way: the pairs are what `--decoder fm` gives
    first, _ = decode(teacher, ClassConditioning(pairs["labels"][:4]), SETTINGS.sampling(), DecoderSpec("fm"),
                      seed=SETTINGS.seed, codebook=book)
    assert torch.equal(first, pairs["tokens"][:4])
    shards[1].unlink()  # an interrupted run: the missing shard comes back the same, the others are kept
    kept = shards[0].stat().st_mtime_ns
    make_pairs(teacher, book, tmp_path, [2, 7], SETTINGS, quiet=True)
    assert shards[0].stat().st_mtime_ns == kept
    assert torch.equal(load_pairs(tmp_path)["tokens"], pairs["tokens"])
    more = replace(SETTINGS, per_class=8)  # more pairs per class: two more shards, the others untouched
    make_pairs(teacher, book, tmp_path, [2, 7], more, quiet=True)
    grown = load_pairs(tmp_path)
    assert len(grown["tokens"]) == 16 and torch.equal(grown["tokens"][:12], pairs["tokens"])
    assert shards[0].stat().st_mtime_ns == kept
    odd = replace(SETTINGS, per_class=9)  # 18 pairs: the last shard holds 2; growing the run makes it whole
    make_pairs(teacher, book, tmp_path / "odd", [2, 7], odd, quiet=True)
    make_pairs(teacher, book, tmp_path / "odd", [2, 7], replace(SETTINGS, per_class=10), quiet=True)
    grown = load_pairs(tmp_path / "odd")
    assert grown["labels"].tolist() == [2, 7] * 10 and torch.equal(grown["tokens"][:16], load_pairs(tmp_path)["tokens"])


def test_pairs_of_another_teacher_or_settings_are_refused(tmp_path):
    teacher, book = tiny_model(), codebook()
    make_pairs(teacher, book, tmp_path, [2], SETTINGS, quiet=True)
    with pytest.raises(FastARError, match="made with another settings"):
        make_pairs(teacher, book, tmp_path, [2], PairSettings(cfg_scale=3.0, per_class=6, shard_size=4), quiet=True)
    with pytest.raises(FastARError, match="made with another teacher"):
        make_pairs(tiny_model(seed=5), book, tmp_path, [2], SETTINGS, quiet=True)
    (tmp_path / "pairs_00000.safetensors").write_bytes(b"broken")
    with pytest.raises(FastARError, match="damaged.*delete it"):
        load_pairs(tmp_path)


def test_the_student_starts_as_the_teacher_shifted_by_one_slot():
    """With token embeddings that are a linear function of the code vectors, the least-squares input layer
    is exact, so the fresh student fed every code as data predicts what the teacher predicts next."""
    teacher, book = tiny_model(), codebook()
    mix = torch.randn(9, teacher.cfg.dim, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        teacher.tok_embeddings.weight.copy_(book @ mix[:8] + mix[8])
    student = distill_dd.student_from_teacher(teacher, book, split=6, t2=5)
    tokens = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(7))
    labels = torch.tensor([1, 4])
    with torch.no_grad():
        _, logits = student.predict(book[tokens], labels, 16)
        want = teacher.training_logits(ClassConditioning(labels), tokens)
    torch.testing.assert_close(logits[:, :-1], want[:, 1:], atol=1e-4, rtol=1e-4)
    assert student.cfg.teacher == model_fingerprint(teacher) and student.cfg.split == 6
    assert student.n_d_embed.weight.abs().sum() == 0 and student.final_layer_conti.linear.weight.abs().sum() == 0


@pytest.mark.parametrize("pixels", [False, True])
def test_the_loss_trains_both_heads_on_the_predicted_positions_only(pixels):
    vq = demo_vq()
    book = vq.codebook()
    teacher = tiny_model(vocab_size=len(book))
    student = distill_dd.student_from_teacher(teacher, book, split=6, t2=5).train()
    g = torch.Generator().manual_seed(8)
    noise, labels = torch.randn(8, 16, 8, generator=g), torch.arange(8)
    tokens = torch.randint(0, len(book), (8, 16), generator=g)
    t = torch.tensor([0, 5] * 4)
    opt = torch.optim.Adam(student.parameters(), lr=1e-2)
    losses = []
    for _ in range(60):
        loss, ce, distance = distill_dd.dd_loss(student, noise, tokens, labels, t, book, vq if pixels else None)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append((ce.item(), distance.item()))
    assert losses[-1][0] < 0.5 * losses[0][0] and losses[-1][1] < 0.5 * losses[0][1]


def test_only_the_positions_from_t_on_carry_loss():
    book = demo_vq().codebook()
    teacher = tiny_model(vocab_size=len(book))
    student = distill_dd.student_from_teacher(teacher, book, split=6, t2=5)
    g = torch.Generator().manual_seed(9)
    noise, tokens = torch.randn(4, 16, 8, generator=g), torch.randint(0, len(book), (4, 16), generator=g)
    continuous, logits = torch.randn(4, 16, 8, generator=g), torch.randn(4, 16, len(book), generator=g) * 5
    student.predict = lambda x, y, t: (continuous, logits)
    _, ce, distance = distill_dd.dd_loss(student, noise, tokens, torch.arange(4), torch.full((4,), 5), book)
    torch.testing.assert_close(ce, torch.nn.functional.cross_entropy(logits[:, 5:].flatten(0, 1), tokens[:, 5:].flatten()))
    torch.testing.assert_close(distance, (continuous[:, 5:] - book[tokens[:, 5:]]).square().sum(-1).mean())


def demo_vq():
    from fastar.model_loaders import load_image_decoder

    return load_image_decoder(DEMO_VQ)


def test_a_tiny_distillation_end_to_end(tmp_path):
    codes = len(demo_vq().codebook())
    teacher = tiny_model(vocab_size=codes)
    save_fp16(teacher, teacher.cfg, tmp_path / "teacher.safetensors")
    args = ["--teacher", tmp_path / "teacher.safetensors", "--vq", DEMO_VQ, "--out", tmp_path / "student.safetensors",
            "--data", tmp_path / "pairs", "--classes", "1,2", "--per-class", "12", "--shard-size", "8", "--t2", "5",
            "--split", "6", "--steps", "30", "--batch", "8", "--lr", "3e-3", "--log-every", "10"]
    parser = distill_dd.argparse.ArgumentParser()
    distill_dd.add_arguments(parser)
    scores = distill_dd.distill(parser.parse_args(list(map(str, args))))
    assert set(scores) == {0, 5}
    student = load_ar_model(tmp_path / "student.safetensors")
    assert isinstance(student, DDStudent) and (student.cfg.split, student.cfg.t2) == (6, 5)
    assert student.cfg.teacher == model_fingerprint(load_ar_model(tmp_path / "teacher.safetensors"))
    manifest = json.loads((tmp_path / "pairs" / "manifest.json").read_text())
    assert manifest["classes"] == [1, 2] and manifest["settings"]["shard_size"] == 8
    assert "per_class" not in manifest["settings"]  # more pairs per class extend the folder
    # resuming continues from the saved student; another teacher's student is refused
    resumed = distill_dd.distill(parser.parse_args(list(map(str, args + ["--resume", tmp_path / "student.safetensors",
                                                                        "--steps", "5"]))))
    assert set(resumed) == {0, 5}
    other = tiny_model(vocab_size=codes, seed=9)
    save_fp16(other, other.cfg, tmp_path / "other.safetensors")
    bad = args + ["--resume", tmp_path / "student.safetensors"]
    bad[1] = tmp_path / "other.safetensors"
    with pytest.raises(FastARError, match="not a student of this teacher"):
        distill_dd.distill(parser.parse_args(list(map(str, bad + ["--data", tmp_path / "pairs2"]))))
