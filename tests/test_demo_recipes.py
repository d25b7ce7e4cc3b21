"""The demo recipes: their shared encoding step (demo_recipes/demo_common.cached_encoding: every recipe's images
encoded once, batch by batch from one seeded generator, joined, cached and read back the same), the autoencoders
they save in two parts (the decoding side bundled, the whole model kept for encoding), and their training loops
run a few steps."""
import importlib
from dataclasses import replace

import numpy as np
import pytest
import torch

from fastar.commands.training import save_fp16
from fastar.demo_recipes import demo_common, train_mar, train_var
from fastar.commands.bench.demo_data import MAR_TOKEN, make_batch, make_captioned_batch
from fastar.errors import FastARError
from fastar.model_loaders import load_ar_model, load_image_decoder
from fastar.model_loaders.shared.demo import DEMO_KL, DEMO_VAR_VQVAE, DEMO_VQ

BUNDLED_AUTOENCODERS = (DEMO_VQ, DEMO_KL, DEMO_VAR_VQVAE)


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    """A fresh .data/ holding, for every bundled autoencoder that ships without its encoder, a whole one where its
    recipe keeps it: the bundled decoder with an untrained encoder (the recipes' encoding steps, not their
    quality, are under test; a fresh checkout has no recipe outputs)."""
    monkeypatch.setattr(demo_common, "DATA_DIR", tmp_path)
    for bundled in BUNDLED_AUTOENCODERS:
        decoder = load_image_decoder(bundled)
        if not decoder.cfg.with_encoder:
            cfg = replace(decoder.cfg, with_encoder=True)
            whole = type(decoder)(cfg)
            whole.load_state_dict(decoder.state_dict(), strict=False)
            save_fp16(whole, cfg, demo_common.whole_autoencoder_path(bundled))
    return tmp_path


def test_every_recipe_encodes_its_images_once_and_reads_them_back(data_dir, monkeypatch):
    tmp_path = data_dir
    runs = {  # the AR demo's across two batches of 64
        "ar": (lambda: demo_common.tokenised("ar", DEMO_VQ, 70, 3, make_batch), 70),
        "text": (lambda: demo_common.tokenised("text", DEMO_VQ, 5, 3, make_captioned_batch), 5),
        "var": (lambda: train_var.scale_codes(DEMO_VAR_VQVAE, 5, 3), 5),
        "mar": (lambda: train_mar.encode(DEMO_KL, 5, 3, MAR_TOKEN), 5),
    }
    for name, (run, n) in runs.items():
        first, again = run(), run()
        assert all(len(column) == n for column in first), name
        assert first[0].dtype in (torch.int16, torch.float16)
        for a, b in zip(first, again):
            assert (torch.equal(a, b) if torch.is_tensor(a) else a == b), name
    assert len(list(tmp_path.glob("*.pt"))) == 4  # one cache each

    def no_decoder(path):
        raise AssertionError("encoded again instead of reading the cache")

    monkeypatch.setattr("fastar.model_loaders.load_image_decoder", no_decoder)
    text = runs["text"][0]()
    assert isinstance(text[2], list) and all(isinstance(caption, str) for caption in text[2])
    _, labels = runs["ar"][0]()
    rng = np.random.default_rng(3)  # the batches are drawn in order from one generator seeded with the seed
    drawn = [make_batch(rng, count)[1] for count in (64, 6)]
    assert torch.equal(labels, torch.from_numpy(np.concatenate(drawn)))


@pytest.mark.parametrize("recipe, args", [
    ("train_ar", ["--steps", "2", "--batch", "4", "--images", "16", "--val-images", "8", "--flat-steps", "2",
                  "--ema", "0.9", "--codebook-init"]),
    ("train_var", ["--steps", "2", "--batch", "4", "--images", "16", "--depth", "1", "--dim", "64",
                   "--val-images", "8", "--judged", "8"]),
])
def test_a_recipe_trains_saves_and_its_model_loads(recipe, args, data_dir, tmp_path):
    """Two steps of the recipe's own loop (the optimiser step and EMA shared with the training commands), its file
    saved where asked, loadable as the model it trains."""
    module = importlib.import_module(f"fastar.demo_recipes.{recipe}")
    out = tmp_path / f"{recipe}.safetensors"
    module.main([*args, "--out", str(out)])
    model = load_ar_model(out)
    assert model.kind in ("token-ar", "next-scale") and all(torch.isfinite(p).all() for p in model.parameters())
    assert recipe != "train_ar" or list(data_dir.glob("ar_t0_tokens_*"))  # --flat-steps drew the flat images too


@pytest.mark.parametrize("recipe, args", [
    ("train_vq", ["--steps", "2", "--batch", "2", "--pool", "4", "--texture", "20", "--codebook", "64",
                  "--held-out", "16"]),
    ("train_kl_vae", ["--steps", "2", "--batch", "2", "--pool", "4", "--held-out", "16"]),
    ("train_var_vqvae", ["--steps", "2", "--batch", "2", "--pool", "8", "--quantiser-steps", "2", "--held-out", "16"]),
])
def test_an_autoencoder_recipe_trains_saves_and_its_decoder_loads(recipe, args, data_dir, tmp_path, monkeypatch):
    """Two steps of each autoencoder recipe's loops (the shared optimiser step), its file loadable as an image
    decoder whose codes or latents decode to finite images, its preview written where previews go; the file at
    --out holds the decoding side only, the whole model is kept for the recipes that encode."""
    module = importlib.import_module(f"fastar.demo_recipes.{recipe}")
    if hasattr(module, "OUT_DIR"):
        monkeypatch.setattr(module, "OUT_DIR", tmp_path / "previews")
    out = tmp_path / f"{recipe}.safetensors"
    module.main([*args, "--out", str(out)])
    decoder, whole = load_image_decoder(out), load_image_decoder(demo_common.whole_autoencoder_path(out))
    assert all(torch.isfinite(p).all() for p in decoder.parameters())
    assert not decoder.cfg.with_encoder and whole.cfg.with_encoder and demo_common.encoding_file(out) != out
    assert all(torch.equal(p, whole.state_dict()[k]) for k, p in decoder.state_dict().items())  # the same decoder
    assert recipe != "train_vq" or decoder.cfg.codebook_size == 64  # --codebook reaches the saved file
    assert not hasattr(module, "OUT_DIR") or any((tmp_path / "previews").glob("*.png"))


def test_a_decoder_without_its_whole_autoencoder_says_which_recipe_makes_it(tmp_path, monkeypatch):
    monkeypatch.setattr(demo_common, "DATA_DIR", tmp_path)
    decoder = load_image_decoder(DEMO_KL)
    bundled = tmp_path / "demo_kl_vae.safetensors"
    save_fp16(decoder, replace(decoder.cfg, with_encoder=False), bundled, drop=demo_common.ENCODER_SIDE)
    with pytest.raises(FastARError, match=r"holds only its decoder.*demo_recipes.train_kl_vae first"):
        demo_common.encoding_file(bundled)
    with pytest.raises(FastARError, match="train_kl_vae"):
        train_mar.encode(bundled, 2, 0, MAR_TOKEN)


def test_the_classifier_recipe_trains_saves_and_its_judge_loads(tmp_path):
    from fastar.commands.bench.classifier import classify, load_classifier
    from fastar.demo_recipes import train_classifier

    out = tmp_path / "judge.safetensors"
    train_classifier.main(["--steps", "2", "--batch", "8", "--texture", "20", "--out", str(out)])
    images, _ = make_batch(np.random.default_rng(0), 4)
    preds, feats = classify(load_classifier(out), images)
    assert len(preds) == 4 and torch.isfinite(torch.as_tensor(feats)).all()


def test_the_judge_trains_on_flat_and_textured_images_alike():
    from fastar.demo_recipes.train_classifier import training_batch

    images, labels = training_batch(np.random.default_rng(0), 8, 20 / 255)
    flat, textured = images[:4].astype(float), images[4:].astype(float)
    assert len(labels) == 8 and images.shape == (8, 128, 128, 3)
    def varying(im):  # the share of pixels that differ from their right neighbour
        return (np.abs(np.diff(im, axis=1)).sum(-1) > 0).mean()

    assert max(varying(im) for im in flat) < 0.2 < 0.5 < min(varying(im) for im in textured)
    assert np.array_equal(training_batch(np.random.default_rng(0), 8, 0.0)[0].shape, (8, 128, 128, 3))


def test_a_run_cut_short_resumes_to_the_uncut_result(tmp_path):
    """Checkpoints: four steps cut after two and resumed end with the uncut run's weights and their EMA, to the bit
    (the generator and the optimiser's moments come back too); the file goes once the run is done."""
    from fastar.commands.training import Checkpoints, adamw, ema_update, setup, train_step

    def run(steps_now: int, path):
        gen = setup(0)
        model, ema = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
        opt = adamw(model, 1e-2, weight_decay=0.05)
        checkpoints = Checkpoints(path, 2, {"model": model, "ema": ema}, opt, gen)
        for step in range(checkpoints.resume(), steps_now):
            x = torch.randn(8, 4, generator=gen)
            train_step(opt, model(x).pow(2).mean(), 1e-2)
            ema_update(ema, model, 0.5)
            checkpoints.after(step)
        return model, ema, checkpoints

    uncut, uncut_ema, _ = run(4, tmp_path / "uncut.pt")
    run(2, tmp_path / "cut.pt")  # stops after two steps, as if the machine went away
    assert (tmp_path / "cut.pt").exists()
    resumed, resumed_ema, checkpoints = run(4, tmp_path / "cut.pt")
    for a, b in [(resumed, uncut), (resumed_ema, uncut_ema)]:
        assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
    assert not torch.equal(resumed_ema.weight, resumed.weight)
    checkpoints.finish()
    assert not (tmp_path / "cut.pt").exists()


def test_the_gpt_can_start_from_the_codebook_codes_that_look_alike_starting_alike():
    """train_ar --codebook-init: the token embeddings and the output head are projections of the VQ's code
    vectors at LlamaGen's init scale, so their similarities are the codebook's (each through its own projection)."""
    from fastar.commands.training import init_weights
    from fastar.demo_recipes.train_ar import init_from_codebook, model_config
    from fastar.model_loaders.llamagen.model import LlamaGenGPT

    codes = load_image_decoder(DEMO_VQ).quantize.codebook().float()
    model = LlamaGenGPT(model_config(codes.shape[0]))
    init_weights(model)
    init_from_codebook(model, DEMO_VQ, torch.Generator().manual_seed(0))
    like_codes = (codes @ codes.T).flatten()
    for weight in (model.tok_embeddings.weight, model.output.weight):
        unit = torch.nn.functional.normalize(weight, dim=-1)
        assert torch.corrcoef(torch.stack([like_codes, (unit @ unit.T).flatten()]))[0, 1] > 0.9
        assert 0.015 < weight.std() < 0.025
    assert not torch.allclose(model.tok_embeddings.weight, model.output.weight)
