"""Emu3 conformance: FastAR's command line on tiny folders saved by the official code, against the official sampler's
greedy codes (CFG 3 against a negative prompt carrying the image header) and the official decoder's images.

- emu3_hf: transformers' Emu3ForConditionalGeneration + Emu3Processor (save_pretrained), codes from its ``generate``
  (``guidance_scale`` with ``negative_prompt_ids``, the row-end layout through ``prefix_allowed_tokens_fn``), two
  prompts of different lengths in one batch on a 4 x 5 grid (an image area and a 5:4 ratio), with BAAI's published
  negative prompt (FastAR's default) and with one given by ``--negative-prompt``; images from its
  ``decode_image_tokens`` and the processor's ``postprocess``.
- emu3_baai: baaivision/Emu3's Emu3ForCausalLM and its tiktoken Emu3Tokenizer (save_pretrained; read by FastAR without
  their code), with a tiny Emu3VisionVQModel in VisionTokenizer/; codes and images from BAAI's image_generation.py run
  as it stands (its prompts with the quality suffix, ratios 1:1 and 16:9 in one batch, the area from config.json,
  greedy); FastAR draws each row in a run of its own.
Rebuild with tests/conformance/build/emu3.py.
"""
import pytest
import torch

from fastar.model_loaders import load_ar_model
from fastar.model_loaders.shared.protocol import PromptConditioning
from fastar.tests.conformance.common import assert_generate_runs, expected, fixture

CASES = ["emu3_hf", "emu3_baai"]


def image_decoder(folder):
    """Where the case's image decoder is: transformers' folder holds it, BAAI's comes as its own folder."""
    return folder / "VisionTokenizer" if (folder / "VisionTokenizer").is_dir() else folder


@pytest.mark.parametrize("decoder", ["ar", "sjd"])
@pytest.mark.parametrize("case", CASES)
def test_greedy_codes_and_images_are_the_official_ones(case, decoder, tmp_path):
    assert_generate_runs(case, image_decoder(fixture(case)), decoder, tmp_path)


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
        size = flag_values(args, "--image-size")
        model = load_ar_model(fixture(case), image_size=int(size[0]) if size else None,
                              aspect_ratio=flag_values(args, "--aspect-ratio")[0])
        conditioning = PromptConditioning(flag_values(args, "--prompt"), flag_values(args, "--negative-prompt") or None)
        rows = model.prefixes(model.prompts.encode(conditioning), cfg=True, **model.uncond_of(conditioning))
        assert rows == run["rows"], f"{run['name']}: the prefixes differ from the official rows"
        for codes, sequence in zip(run["codes"], run["sequences"]):
            assert model.image_sequence(torch.tensor(codes)) == rows[0][-len(model.cfg.image_prefix):] + sequence


def test_baai_tiktoken_files_read_as_their_tokenizer_reads_them():
    """BAAI's tokenizer (tiktoken over emu3.tiktoken, NFC, Qwen's split pattern, special tokens anywhere in the text),
    made by FastAR into a ``tokenizers`` BPE without running BAAI's code, gives its ids to every recorded text."""
    model = load_ar_model(fixture("emu3_baai"))
    for text, ids in expected("emu3_baai")["source"]["tokenizer_samples"].items():
        assert model.prompts.tokenizer.encode(text, add_special_tokens=False).ids == ids, repr(text)
