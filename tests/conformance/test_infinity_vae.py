"""Infinity's BSQ VAE conformance: FastAR's next-scale accumulation and decoder against the release's own
``autoregressive_infer_cfg`` and ``vae.decode``, on two tiny VAEs saved as the release saves them (``{"vae": sd}``):
the 2B's layout (d 32, 16 pixels a cell, Infinity's wrapped key names) and the 8B's (d 14, 8 pixels a cell, its
transformer's 56 bits a token pixel-shuffled to 2 x 2 cells; plain key names). Two images a batch, scales that are not
square. Rebuild with tests/conformance/build/infinity_vae.py.

Per scale: FastAR's codes of the official loop's bits equal ``indices_to_codes``'s, and the next scale's input (as the
transformer flattens it: pixel_unshuffle 2 first for the 8B) the official loop's within 1e-5; the final f_hat the one
the loop decodes; the decode within 1e-4 of the release's (clamped as it clamps); the images through FastAR's image
path within 2/255 of the loop's (it truncates to uint8, FastAR rounds).
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from fastar.model_loaders import load_image_decoder
from fastar.model_loaders.shared.checkpoint import detect_family, read_state_dict
from fastar.pipeline import decode_images
from fastar.tests.conformance.common import assert_image_close, expected, fixture

CASE = "infinity_vae"
RUNS = expected(CASE)["runs"]
TOLERANCE = 1e-5  # codes, f_hat and the next inputs: the same fp32 arithmetic
DECODE_TOLERANCE = 1e-4  # the decoder's output, before pixels


def official(run) -> dict:
    with np.load(fixture(CASE) / run["arrays"]) as arrays:
        return {k: torch.from_numpy(arrays[k]) for k in arrays.files}


def as_transformer_input(x: torch.Tensor, run) -> torch.Tensor:
    """The next input ``[B, d, h, w]`` as the loop hands it to the transformer: ``[B, h * w, d]`` (the 8B's 2 x 2
    cells as one token of 4d first)."""
    return (F.pixel_unshuffle(x, 2) if run["patchify"] else x).flatten(2).transpose(1, 2)


def worst(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, f"{tuple(a.shape)} where the official has {tuple(b.shape)}"
    return float((a - b).abs().max())


@pytest.mark.parametrize("run", RUNS, ids=[r["name"] for r in RUNS])
def test_accumulation_and_decode_are_the_official_ones(run, tmp_path):
    path = fixture(CASE) / run["file"]
    assert detect_family(read_state_dict(path)[0]) == "infinity-vae"
    vae, ref = load_image_decoder(path), official(run)
    assert (vae.cfg.codebook_dim, vae.cfg.patch_size) == (run["codebook_dim"], run["patch_size"])
    shapes = [tuple(s) for s in run["vae_grid"]]
    f_hat = torch.zeros(2, vae.cfg.codebook_dim, *shapes[-1])
    for scale in range(len(shapes)):
        bits = ref[f"bits_{scale}"]
        assert worst(vae.codes_of_bits(bits), ref[f"codes_{scale}"]) <= TOLERANCE, f"scale {scale}: codes"
        f_hat, inputs = vae.next_input(f_hat, bits, scale, shapes)
        if scale + 1 < len(shapes):
            assert worst(as_transformer_input(inputs, run), ref[f"input_{scale}"]) <= TOLERANCE, f"scale {scale}: input"
        else:
            assert inputs is None
    assert worst(f_hat, ref["f_hat"]) <= TOLERANCE, "the summed codes differ from the official loop's"
    with torch.no_grad():
        assert worst(vae.decode(f_hat).clamp(-1, 1), ref["decoded"]) <= DECODE_TOLERANCE, "the decode differs"
    for i, pixels in enumerate(decode_images(vae, f_hat)):  # FastAR's path from decoder input to 8-bit RGB
        Image.fromarray(pixels).save(tmp_path / f"{i}.png")
        assert_image_close(tmp_path / f"{i}.png", fixture(CASE) / run["images"][i])
