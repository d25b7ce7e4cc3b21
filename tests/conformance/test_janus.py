"""Janus-Pro conformance: FastAR's command line on tiny folders saved by the official code, against the official
sampler's greedy codes (CFG 5, two prompts of different lengths in one batch) and the official VQ decoder's images.

- janus_transformers: transformers' JanusForConditionalGeneration + JanusProcessor (save_pretrained), codes from
  its ``generate(generation_mode="image")``, images from its ``decode_image_tokens``;
- janus_deepseek: deepseek-ai/Janus's MultiModalityCausalLM (save_pretrained) with DeepSeek's tokenizer files,
  codes from generation_inference.py's loop (argmax for multinomial), images from its VQ's ``decode_code``.
Rebuild with tests/conformance/build/janus.py.
"""
import pytest

from fastar.tests.conformance.common import assert_generate_runs, fixture

CASES = ["janus_transformers", "janus_deepseek"]


@pytest.mark.parametrize("decoder", ["ar", "sjd"])
@pytest.mark.parametrize("case", CASES)
def test_greedy_codes_and_images_are_the_official_ones(case, decoder, tmp_path):
    assert_generate_runs(case, fixture(case), decoder, tmp_path)
