"""MAR from the command line and the loaders, with official-format stand-ins: a MAR checkpoint as LTH14/mar
saves it ({"model", "model_ema", "args"}), an LDM KL autoencoder ({"model": sd} with loss.* keys), FastAR
safetensors; generation with ar and cspd, latents out and back in through ``decode``, and the refusals."""
import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from fastar.errors import FastARError
from fastar.model_loaders import load_ar_model, load_image_decoder
from fastar.model_loaders.shared.demo import DEMO_AR, DEMO_VQ
from fastar.model_loaders.mar.model import MAR
from fastar.tests.tiny_mar import mar_config, official_kl, official_mar, random_model
from fastar.commands.training import save_fp16

@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("mar")
    official_kl(d / "kl16.ckpt")
    official_mar(d / "mar_target.pth", mar_config(), 1, num_heads=2)
    save_fp16(random_model(MAR, mar_config(dim=16, decoder_dim=16, head_width=16), 2), mar_config(
        dim=16, decoder_dim=16, head_width=16), d / "mar_draft.safetensors")
    save_fp16(random_model(MAR, mar_config(token_dim=8), 3), mar_config(token_dim=8), d / "mar_other_latents.safetensors")
    return d


def fastar(*args, cwd):
    return subprocess.run([sys.executable, "-m", "fastar", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=600)


def test_official_files_load_with_ema_weights_and_args(files):
    model = load_ar_model(files / "mar_target.pth")
    assert model.kind == "masked-ar" and model.cfg.grid == (4, 4) and model.cfg.buffer == 2
    assert model.cfg.encoder_heads == 2 and model.cfg.num_classes == 3 and model.cfg.token_dim == 4
    assert model.head.input_proj.weight.dtype == torch.float32
    half = load_ar_model(files / "mar_target.pth", dtype=torch.bfloat16)  # the transformer in bf16 ...
    assert half.z_proj.weight.dtype == torch.bfloat16
    ema = torch.load(files / "mar_target.pth", weights_only=False)["model_ema"]
    for name, value in half.diffloss.state_dict().items():  # ... the head exactly as stored, never rounded
        assert value.dtype == torch.float32 and torch.equal(value, ema[f"diffloss.{name}"]), name
    vae = load_image_decoder(files / "kl16.ckpt")
    assert vae.input_kind == "latents" and vae.cfg.embed_dim == 4 and vae.cfg.downsample == 2


def test_heads_come_from_the_official_table_or_a_config(tmp_path):
    official_mar(tmp_path / "odd.pth", mar_config(), 1)  # no num_heads, not an official size
    with pytest.raises(FastARError, match=r'1-block, 32-wide MAR .*mar_base.*Write odd.json next to odd.pth .*"num_heads"'):
        load_ar_model(tmp_path / "odd.pth")
    (tmp_path / "odd.json").write_text('{"num_heads": 4}')
    assert load_ar_model(tmp_path / "odd.pth").cfg.encoder_heads == 4


def test_generate_ar_and_cspd_write_images_latents_and_stats(files, tmp_path):
    common = ("generate", "--model", files / "mar_target.pth", "--vae", files / "kl16.ckpt", "--classes", "0,2",
              "--num-iter", 4, "--diffusion-steps", 5, "--cfg", 1.5, "--quiet")
    r = fastar(*common, "--decoder", "ar", "--out", tmp_path / "ar.png", "--latents-out", tmp_path / "ar.npy", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    latents = np.load(tmp_path / "ar.npy")
    assert latents.shape == (2, 4, 4, 4) and latents.dtype == np.float32
    assert Image.open(tmp_path / "ar_0.png").size == (8, 8)
    for verify in ("steps", "merged"):
        r = fastar(*common, "--decoder", "cspd", "--drafter", files / "mar_draft.safetensors", "--gamma", 2,
                   "--cspd-verify", verify, "--stats-out", tmp_path / f"{verify}.json", cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert re.search(r"in \d forwards", r.stdout) and "drafter forwards" in r.stdout and "drafts kept" in r.stdout
    r = fastar(*common, "--decoder", "cspd", "--drafter", files / "mar_draft.safetensors", "--gamma", 2, "--cspd-verify",
               "merged", "--reuse", "--reuse-start", 0.0, "--stats-out", tmp_path / "cspd_lazy.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert re.search(r"feature reuse: [1-9]\d* of \d+ model calls reused the cache", r.stdout), r.stdout
    stats = json.loads((tmp_path / "cspd_lazy.json").read_text())
    assert stats["decoder"] == "cspd+reuse" and 0 < stats["transformer_work"] < 1
    r = fastar(*common, "--reuse", "--reuse-start", 0.25, "--refresh-every", 2, "--stats-out", tmp_path / "lazy.json",
               cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "feature reuse: 1 of 4 steps reused the cache" in r.stdout, r.stdout
    stats = json.loads((tmp_path / "lazy.json").read_text())
    assert stats["decoder"] == "ar+reuse" and stats["recomputed_share"][:2] == [1.0, 1.0]
    assert 0 < stats["transformer_work"] < 1 and stats["settings"]["reuse"]["refresh_every"] == 2
    r = fastar("decode", "--vae", files / "kl16.ckpt", "--latents-in", tmp_path / "ar.npy", "--out", tmp_path / "back.png",
               cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert np.array_equal(np.asarray(Image.open(tmp_path / "back_1.png")), np.asarray(Image.open(tmp_path / "ar_1.png")))


@pytest.mark.parametrize("extra,message", [
    (("--decoder", "cspd", "--model", DEMO_AR), "cspd needs a MAR model; this is a LlamaGen GPT"),
    (("--decoder", "sjd",), r"sjd needs a token model \(LlamaGen\); this is a MAR model: use one of ar, cspd"),
    (("--decoder", "cspd"), "CSpD needs a draft model"),
    (("--decoder", "cspd", "--drafter", "OTHER"), "the draft MAR has 8 latent channels but the target has 4"),
    (("--num-iter", 17), "num_iter 17: .* 1 to 16 steps"),
    (("--vq", DEMO_VQ), "a MAR model writes continuous latents: its image decoder is a KL autoencoder"),
    (("--top-k", 5), "--top-k and --top-p act on token probabilities"),
    (("--decoder", "cspd", "--drafter", "DRAFT", "--cspd-verify", "merged", "--prefill", 1.5), "pre-fill 1.5"),
    (("--reuse", "--refresh-every", 1), "refresh every 1: use 2 or more"),
    (("--reuse", "--head-refresh-every", 1), "head refresh every 1: use 0"),
    (("--reuse", "--reuse-start", 0.8, "--reuse-end", 0.5), "give 0 <= start percent < end percent <= 1"),
    (("--reuse", "--model", DEMO_AR), "--reuse reuses a MAR model's features between its steps"),
])
def test_refusals_say_what_to_do(files, tmp_path, extra, message):
    args = ["generate", "--model", files / "mar_target.pth", "--vae", files / "kl16.ckpt", "--quiet", *extra]
    args = [files / "mar_other_latents.safetensors" if a == "OTHER" else files / "mar_draft.safetensors" if a == "DRAFT"
            else a for a in args]
    if "--model" in extra:  # the LlamaGen demo model takes the place of the MAR
        args = ["generate", "--quiet", *extra]
    r = fastar(*args, cwd=tmp_path)
    assert r.returncode == 2 and re.search(message, " ".join(r.stderr.split())), r.stderr
    assert "Traceback" not in r.stderr


def test_truncated_files_say_re_download(files, tmp_path):
    data = (files / "mar_target.pth").read_bytes()
    (tmp_path / "cut.pth").write_bytes(data[: len(data) // 2])
    with pytest.raises(FastARError, match="truncated or corrupt: re-download it"):
        load_ar_model(tmp_path / "cut.pth")
    kl = (files / "kl16.ckpt").read_bytes()
    (tmp_path / "cut.ckpt").write_bytes(kl[: len(kl) // 3])
    with pytest.raises(FastARError, match="truncated or corrupt: re-download it"):
        load_image_decoder(tmp_path / "cut.ckpt")


def test_decode_refuses_the_wrong_decoder(files, tmp_path):
    np.save(tmp_path / "l.npy", np.zeros((1, 4, 4, 4), np.float32))
    r = fastar("decode", "--vq", DEMO_VQ, "--latents-in", tmp_path / "l.npy", "--out", tmp_path / "x.png", cwd=tmp_path)
    # a VQ decodes code-space latents too (a DD student's output), but only of its code width
    assert r.returncode == 2 and "a VQ tokenizer decodes [B, 8, h, w]" in r.stderr, r.stderr
    np.save(tmp_path / "bad.npy", np.zeros((1, 3, 4, 4), np.float32))
    r = fastar("decode", "--vae", files / "kl16.ckpt", "--latents-in", tmp_path / "bad.npy", "--out", tmp_path / "x.png",
               cwd=tmp_path)
    assert r.returncode == 2 and "decodes [B, 4, h, w]" in r.stderr, r.stderr


def test_bench_mar_compares_cspd_with_the_mar_sampler_at_several_step_counts(tmp_path):
    r = fastar("bench", "--mar", "--samples", 2, "--timing-runs", 1, "--num-iter", 4, "--diffusion-steps", 5,
               "--out", tmp_path / "bench", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "bench" / "bench_mar.json").read_text())
    rows = report["results"]
    assert list(rows) == ["mar", "mar@64", "mar@32", "mar@16", "cspd-steps", "cspd-merged", "cspd-relaxed-steps",
                          "cspd-relaxed-merged", "lazy", "lazy-reuse0.5", "lazy-reuse0.9", "lazy-refresh3",
                          "lazy-refresh8", "lazy-start0.2", "lazy-head0", "lazy-head3", "recap-like",
                          "cspd-steps-lazy", "cspd-merged-lazy"]
    assert rows["cspd-merged-lazy"]["transformer_work"] < 1.0 and rows["cspd-merged-lazy"]["cspd"]["ratio_temperature"] == 1
    assert rows["mar"]["transformer_work"] == 1.0 and rows["mar"]["settings"]["reuse"] is None
    assert rows["lazy"]["transformer_work"] < 1.0 and rows["lazy"]["settings"]["reuse"]["token_reuse"] == 0.75
    assert rows["mar"]["target_calls"] == 4 and rows["mar@32"]["target_calls"] == 32
    assert rows["mar"]["frechet_vs_mar"] < 1e-6 and rows["mar"]["latency_ratio"] == 1.0
    assert all(0 <= row["class_accuracy"] <= 1 and row["frechet"] > 0 for row in rows.values())
    assert rows["cspd-steps"]["draft_calls"] > 0
    assert "| cspd-merged |" in (tmp_path / "bench" / "bench_mar.md").read_text()
    relaxed = rows["cspd-relaxed-merged"]  # the reference code's rule: its temperature and path factor
    assert relaxed["decoder"] == "cspd-relaxed" and relaxed["cspd"]["ratio_temperature"] == 42.0
    assert relaxed["cspd"]["path_factor"] and relaxed["acceptance_rate"] is not None


def test_bench_mar_runs_the_rows_asked_for_and_names_the_others():
    from types import SimpleNamespace

    from fastar.commands.bench.mar import rows_for

    args = SimpleNamespace(num_iter=8, cfg=3.0, cfg_schedule="linear", temperature=1.0, diffusion_steps=5, top_k=None,
                           top_p=None, reuse=False, reuse_start=0.1, reuse_end=1.0, refresh_every=4, token_reuse=0.75,
                           head_refresh_every=7, gamma=None, prefill=0.05, cspd_verify="steps", cspd_temperature=None,
                           cspd_path_factor=False, mar_steps="16,4", mar_rows="cspd-merged-lazy, mar@4")
    model = SimpleNamespace(cfg=SimpleNamespace(num_tokens=16), defaults={})
    assert [row.label for row in rows_for(args, model)] == ["mar", "mar@4", "cspd-merged-lazy"]
    with pytest.raises(FastARError, match="--mar-rows: no row lazy@9; the rows are mar, mar@16, mar@4, cspd-steps"):
        rows_for(SimpleNamespace(**{**vars(args), "mar_rows": "lazy@9"}), model)
