"""Janus-Pro conformance: FastAR's command line on tiny folders saved by the official code, against the official
sampler's greedy codes (CFG 5, two prompts of different lengths in one batch) and the official VQ decoder's images.

- janus_transformers: transformers' JanusForConditionalGeneration + JanusProcessor (save_pretrained), codes from
  its ``generate(generation_mode="image")``, images from its ``decode_image_tokens``;
- janus_deepseek: deepseek-ai/Janus's MultiModalityCausalLM (save_pretrained) with DeepSeek's tokenizer files,
  codes from generation_inference.py's loop (argmax for multinomial), images from its VQ's ``decode_code``.
Rebuild with tests/conformance/build/janus.py.
"""
import pytest

from fastar.tests.conformance.common import assert_image_close, expected, fastar, fixture, generated_codes

CASES = ["janus_transformers", "janus_deepseek"]


@pytest.mark.parametrize("decoder", ["ar", "sjd"])
@pytest.mark.parametrize("case", CASES)
def test_greedy_codes_and_images_are_the_official_ones(case, decoder, tmp_path):
    folder = fixture(case)
    for run in expected(case)["runs"]:
        tokens, out = tmp_path / f"{run['name']}.json", tmp_path / f"{run['name']}.png"
        r = fastar("generate", "--model", folder, "--vq", folder, "--decoder", decoder, *run["args"], "--quiet",
                   "--tokens-out", tokens, "--out", out, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert generated_codes(tokens) == run["codes"], f"{case} {run['name']} {decoder}: not the official codes"
        for i, image in enumerate(run["images"]):
            produced = out if len(run["images"]) == 1 else tmp_path / f"{run['name']}_{i}.png"
            assert_image_close(produced, folder / image)
