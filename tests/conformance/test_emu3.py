"""Emu3 conformance: FastAR's command line on a tiny folder saved by the official code, against the official sampler's
greedy codes (CFG 3 against a negative prompt carrying the image header, two prompts of different lengths in one
batch, a 4 x 5 grid from an image area and a 5:4 ratio) and the official decoder's images.

- emu3_hf: transformers' Emu3ForConditionalGeneration + Emu3Processor (save_pretrained), codes from its ``generate``
  (``guidance_scale`` with ``negative_prompt_ids``, the row-end layout through ``prefix_allowed_tokens_fn``), with
  BAAI's published negative prompt (FastAR's default) and with one given by ``--negative-prompt``; images from its
  ``decode_image_tokens`` and the processor's ``postprocess``.
Rebuild with tests/conformance/build/emu3.py.
"""
import pytest
import torch

from fastar.model_loaders import load_ar_model
from fastar.model_loaders.shared.protocol import PromptConditioning
from fastar.tests.conformance.common import assert_image_close, expected, fastar, fixture, generated_codes

CASES = ["emu3_hf"]


def image_decoder_ready() -> bool:
    """The Emu3 image decoder is written beside this model (model_loaders/emu3/vqvae.py); until it loads the folder's
    VQ model, the codes alone are compared."""
    try:
        from fastar.model_loaders.emu3 import vqvae  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("decoder", ["ar", "sjd"])
@pytest.mark.parametrize("case", CASES)
def test_greedy_codes_and_images_are_the_official_ones(case, decoder, tmp_path):
    folder = fixture(case)
    decode = image_decoder_ready()
    for run in expected(case)["runs"]:
        tokens, out = tmp_path / f"{run['name']}.json", tmp_path / f"{run['name']}.png"
        images = ["--vq", folder, "--out", out] if decode else []
        r = fastar("generate", "--model", folder, "--decoder", decoder, *run["args"], "--quiet", "--tokens-out", tokens,
                   *images, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert generated_codes(tokens) == run["codes"], f"{case} {run['name']} {decoder}: not the official codes"
        for i, image in enumerate(run["images"] if decode else []):
            assert_image_close(tmp_path / f"{run['name']}_{i}.png", folder / image)


def flag_values(args: list, flag: str) -> list:
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


@pytest.mark.parametrize("case", CASES)
def test_rows_and_image_sequences_are_the_official_ones(case):
    """What FastAR feeds and what it says the model writes, token for token against the official run: each row's
    prefix (bos, prompt, ``<|image start|>``, the size text, ``<|image token|>``; CFG's rows with the negative prompt
    and the same header) and each image's whole sequence (every row ended, the last one too, then ``<|extra_201|>``,
    ``<|image end|>``, eos), which the codes alone do not show (the last row end and the closing tokens are never fed)."""
    for run in expected(case)["runs"]:
        args = run["args"]
        model = load_ar_model(fixture(case), image_size=int(flag_values(args, "--image-size")[0]),
                              aspect_ratio=flag_values(args, "--aspect-ratio")[0])
        conditioning = PromptConditioning(flag_values(args, "--prompt"), flag_values(args, "--negative-prompt") or None)
        rows = model.prefixes(model.prompts.encode(conditioning), cfg=True, **model.uncond_of(conditioning))
        assert rows == run["rows"], f"{run['name']}: the prefixes differ from the official rows"
        for codes, sequence in zip(run["codes"], run["sequences"]):
            assert model.image_sequence(torch.tensor(codes)) == rows[0][-len(model.cfg.image_prefix):] + sequence
