"""The text-to-image demo's pieces: the demo VQ converted to Chameleon's VQGAN format decodes every code as the
demo VQ does; captions say what the image shows; the trainer's sequences put every image code where the model
reads it; and a short training run in a subprocess writes a folder that loads as a Lumina-mGPT model."""
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

from fastar.model_loaders import load_ar_model, load_image_decoder
from fastar.model_loaders.shared.demo import DEMO_VQ
from fastar.model_loaders.shared.protocol import PromptConditioning
from fastar.model_loaders.chameleon.vqgan import VQGAN
from fastar.model_loaders.llamagen.vq import VQModel
from fastar.commands.training import save_fp16
from fastar.demo_recipes import train_text_demo
from fastar.commands.bench.demo_data import HIGH, LOW, make_captioned_batch

needs_demo_vq = pytest.mark.skipif(not DEMO_VQ.exists(), reason="the demo VQ is not bundled")


@needs_demo_vq
def test_the_converted_vq_decodes_every_code_as_the_demo_vq(tmp_path):
    from safetensors.torch import save_file

    vq = load_image_decoder(DEMO_VQ)
    save_file(train_text_demo.convert_vq(vq), str(tmp_path / "vqgan.safetensors"))
    vqgan = load_image_decoder(tmp_path / "vqgan.safetensors")
    size = vq.cfg.codebook_size
    assert isinstance(vqgan, VQGAN) and vqgan.cfg.codebook_size == size and vqgan.cfg.downsample == 8
    codes = torch.arange(size).view(-1, 16, 16)  # every code, at every kind of position
    with torch.no_grad():
        assert torch.equal(vqgan.decode(codes), vq.decode(codes))


def test_captions_name_the_shape_and_the_colours():
    images, labels, captions = make_captioned_batch(np.random.default_rng(0), 16, classes=np.arange(16) % 8,
                                                    backgrounds=[[0, 0, 1]] * 16)
    assert captions[5] == "a yellow ring on a blue background"
    corner = images[:, 0, 0].astype(float) / 255  # the background at a corner (stripes may cover it: skip them)
    backgrounds = [c for c, label in zip(corner, labels) if label not in (3, 4)]
    assert np.allclose(backgrounds, [LOW, LOW, HIGH], atol=0.01)


def whole_vq(path):
    """The bundled demo VQ's decoder with an untrained encoder: a VQ the trainer can tokenise with on a clean
    checkout (the bundled file holds its decoding side only; the trained encoder stays with its recipe)."""
    decoder = load_image_decoder(DEMO_VQ)
    vq = VQModel(replace(decoder.cfg, with_encoder=True))
    vq.load_state_dict(decoder.state_dict(), strict=False)
    save_fp16(vq, vq.cfg, path)
    return path


def test_sequences_put_every_code_where_the_model_reads_it(tmp_path):
    """A short run of the trainer (subprocess), then the sequences of its model: each code at its slot,
    row ends after each row, prompts left-padded, a dropped caption starting at boi."""
    if not DEMO_VQ.exists():
        pytest.skip("the demo VQ is not bundled")
    out = tmp_path / "demo_text"
    vq = whole_vq(tmp_path / "vq.safetensors")
    r = subprocess.run([sys.executable, "-m", "fastar.demo_recipes.train_text_demo", "--steps", "2", "--images", "64",
                        "--val-images", "32", "--batch", "4", "--vq", vq, "--out", out,
                        "--vqgan-out", tmp_path / "vqgan.safetensors"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    model = load_ar_model(out)
    size = load_image_decoder(DEMO_VQ).cfg.codebook_size
    assert model.what == "a Lumina-mGPT model" and model.grid == (16, 16) and model.vocab_size == size
    prompts = model.prompts.encode(PromptConditioning(["a red ring on a cyan background"])) + [[]]
    codes = torch.randint(0, size, (2, 256), generator=torch.Generator().manual_seed(0))
    ids, valid, at = train_text_demo.sequences(model, prompts, codes)
    assert torch.equal(ids[:, at], model.image_ids[codes])
    assert bool((ids[:, at[15] + 1] == model.cfg.row_end).all()) and bool((ids[:, -1] == model.cfg.eoi).all())
    dropped = ids[1][valid[1]]
    assert dropped[: len(model.cfg.image_prefix)].tolist() == model.cfg.image_prefix
    assert not bool(valid[1, : len(prompts[0])].any())  # the shorter row is left-padded
