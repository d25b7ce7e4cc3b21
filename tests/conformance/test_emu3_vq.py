"""Emu3's vision tokenizer conformance: FastAR's decoder, loaded from each release layout as saved by the official
code, against the official decodes of the same codes (two batches of two images, 4 x 6 and 6 x 4 codes).

- Emu3-Gen-hf/: transformers' Emu3ForConditionalGeneration folder (the VQ model under ``vqmodel.``, beside the text
  model), official: ``decode_image_tokens`` / ``Emu3VQVAE.decode`` and ``Emu3ImageProcessor.postprocess``;
- Emu3-VisionTokenizer/: BAAI's Emu3VisionVQModel folder, official: its ``decode`` and
  ``Emu3VisionVQImageProcessor.postprocess``.
Both carry the encoder, which FastAR leaves out, and a preprocessor_config.json whose mean and std are not the
release's, so the images also prove they are read. The images are compared as the pipeline makes them, and as
``python -m fastar decode --tokens-in`` writes them. Rebuild with tests/conformance/build/emu3_vq.py.
"""
import json

import numpy as np
import pytest
import torch
from PIL import Image

from fastar import model_loaders
from fastar.model_loaders.emu3.vqvae import load_emu3_vq
from fastar.model_loaders.shared.checkpoint import read_state_dict
from fastar.pipeline import decode_images
from fastar.tests.conformance.common import assert_image_close, expected, fastar, fixture

CASE = "emu3_vq"
RUNS = expected(CASE)["runs"]
FRAME_TOLERANCE = 1e-4  # the decoders' normalised output, before pixels


def load(layout: str):
    sd, info = read_state_dict(fixture(CASE) / layout)
    return load_emu3_vq(sd, info=info)


@pytest.mark.parametrize("run", RUNS, ids=[r["name"] for r in RUNS])
def test_frames_and_images_are_the_official_ones(run, tmp_path):
    decoder, codes = load(run["layout"]), torch.tensor(run["codes"])
    official = np.load(fixture(CASE) / run["frames"])  # [B, frames, 3, H, W]
    h, w = run["grid"]
    assert official.shape == (len(codes), decoder.cfg.frames, 3, h * decoder.cfg.downsample, w * decoder.cfg.downsample)
    with torch.no_grad():
        every = decoder.frames(codes).numpy()
        first = decoder.frames(codes, every_frame=False).numpy()
    assert np.abs(every - official).max() <= FRAME_TOLERANCE, "the frames differ from the official decode's"
    assert first.shape[1] == 1 and np.abs(first[:, 0] - official[:, 0]).max() <= FRAME_TOLERANCE
    for i, pixels in enumerate(decode_images(decoder, codes)):  # FastAR's path from codes to 8-bit pixels
        Image.fromarray(pixels).save(tmp_path / f"{i}.png")
        assert_image_close(tmp_path / f"{i}.png", fixture(CASE) / run["images"][i])


def test_both_layouts_load_the_same_decoder():
    hf, baai = (load(layout) for layout in ("Emu3-Gen-hf", "Emu3-VisionTokenizer"))
    assert hf.cfg == baai.cfg and hf.cfg.image_mean == tuple(expected(CASE)["source"]["image_mean"])
    hf_state, baai_state = hf.state_dict(), baai.state_dict()
    assert hf_state.keys() == baai_state.keys()
    assert all(torch.equal(hf_state[k], baai_state[k]) for k in hf_state)


@pytest.mark.skipif("emu3-vq" not in model_loaders.LOADERS, reason="Emu3's family is not registered yet")
@pytest.mark.parametrize("layout", ["Emu3-Gen-hf", "Emu3-VisionTokenizer"])
def test_the_command_line_decodes_the_official_images(layout, tmp_path):
    """``python -m fastar decode --tokens-in --vq FOLDER``, as a user decodes saved codes."""
    for run in (r for r in RUNS if r["layout"] == layout):
        tokens = tmp_path / f"{run['name']}.json"
        tokens.write_text(json.dumps({"tokens": [sum(image, []) for image in run["codes"]], "grid": run["grid"]}))
        r = fastar("decode", "--tokens-in", tokens, "--vq", fixture(CASE) / layout, "--out", tmp_path / "decoded.png",
                   cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        for i, image in enumerate(run["images"]):
            assert_image_close(tmp_path / f"decoded_{i}.png", fixture(CASE) / image)
