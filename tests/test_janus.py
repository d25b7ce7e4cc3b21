"""The Janus adapter against transformers' JanusForConditionalGeneration on a tiny random model, loaded from
both folder layouts (transformers' conversion and DeepSeek's original): teacher-forced image logits of cond
rows and CFG's padded uncond rows, greedy decoding against transformers' own image ``generate``, and the VQ
decode inside the folder against transformers' ``JanusVQVAE.decode``."""
import json
import subprocess
import sys

import pytest
import torch
from PIL import Image

from fastar.model_loaders import load_ar_model, load_image_decoder
from fastar.model_loaders.janus.loader import special_token
from fastar.model_loaders.shared.protocol import PromptConditioning
from fastar.samplers.token_loops.jacobi import ar_decode
from fastar.samplers.processing import SamplingSettings
from fastar.tests.tiny_janus import CODES, GRID, hf_model, vocabulary, write_converted, write_deepseek

PROMPTS = ["a red ring on a blue background", "a dog"]


def fastar(*args, cwd):
    return subprocess.run([sys.executable, "-m", "fastar", *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def reference():
    return hf_model(seed=0)


@pytest.fixture(scope="module", params=["converted", "deepseek"])
def folder(request, reference, tmp_path_factory):
    write = write_converted if request.param == "converted" else write_deepseek
    return write(tmp_path_factory.mktemp("janus") / f"tiny-janus-{request.param}", reference)


@pytest.fixture(scope="module")
def model(folder):
    return load_ar_model(folder)


def uncond(prompt: list[int]) -> list[int]:
    vocab = vocabulary()
    keep = {vocab["<｜begin▁of▁sentence｜>"], vocab["<begin_of_image>"]}
    return [t if t in keep else vocab["<｜▁pad▁｜>"] for t in prompt]


@torch.no_grad()
def reference_logits(reference, prefix: list[int], codes: torch.Tensor) -> torch.Tensor:
    """[N, CODES]: transformers' generation head for every image token given the ones before it."""
    text = reference.model.language_model.embed_tokens(torch.tensor([prefix]))
    images = reference.prepare_embeddings_for_image_generation(codes[None])
    hidden = reference.model.language_model(inputs_embeds=torch.cat([text, images], 1)).last_hidden_state[0]
    return reference.model.generation_head(hidden[len(prefix) - 1: len(prefix) - 1 + len(codes)])


def test_the_folder_layouts_load_the_same_model(model):
    assert model.vocab_size == CODES and model.grid == (GRID, GRID) and model.cfg.decoder.n_kv_head == 2
    prompts = model.prompts.encode(PromptConditioning(PROMPTS))
    vocab = vocabulary()
    assert prompts[1][:2] == [vocab["<｜begin▁of▁sentence｜>"], vocab["<|User|>"]] and prompts[1][-1] == vocab["<begin_of_image>"]


def test_teacher_forced_logits_equal_transformers(model, reference):
    N = GRID * GRID
    codes = torch.randint(0, CODES, (2, N), generator=torch.Generator().manual_seed(1))
    prompts = model.prompts.encode(PromptConditioning(PROMPTS))
    session = model.start(PromptConditioning(PROMPTS), cfg=True, max_window=4)
    outs = [session.first]
    for start in range(0, N - 1, 4):
        width = min(4, N - 1 - start)
        outs.append(session.forward(codes[:, start:start + width], torch.tensor([start, start])))
    for b in range(2):
        for kind, prefix in (("cond", prompts[b]), ("uncond", uncond(prompts[b]))):
            ours = torch.cat([getattr(o, kind)[b] for o in outs])
            expected = reference_logits(reference, prefix, codes[b])
            assert torch.allclose(ours, expected, atol=2e-5, rtol=1e-4), (kind, b, (ours - expected).abs().max())


def test_greedy_decoding_equals_transformers_generate(model, reference):
    from transformers import GenerationConfig

    vocab = vocabulary()
    conditioning = PromptConditioning(PROMPTS[:1])
    codes, _ = ar_decode(model, conditioning, SamplingSettings(cfg_scale=4.0, temperature=0.0), generator=torch.Generator())
    prompt = model.prompts.encode(conditioning)[0]
    config = GenerationConfig(do_sample=False, guidance_scale=4.0, bos_token_id=0, pad_token_id=vocab["<｜▁pad▁｜>"],
                              generation_kwargs={"boi_token_id": vocab["<begin_of_image>"]},
                              max_new_tokens=GRID * GRID)
    with torch.no_grad():
        ids = torch.tensor([prompt])
        expected = reference.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                      generation_mode="image")
    assert torch.equal(codes, expected)


def test_the_vq_in_the_folder_decodes_as_transformers(folder, reference):
    vq = load_image_decoder(folder)
    codes = torch.randint(0, CODES, (2, GRID, GRID), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference.model.vqmodel.decode(codes.flatten(1))
        assert torch.allclose(vq.decode(codes), expected, atol=1e-5), (vq.decode(codes) - expected).abs().max()


def without_tokenizer_pad(folder):
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings.pop("pad_token")
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))


def test_the_pad_token_is_found_where_the_official_samplers_find_it(reference, tmp_path):
    vocab = vocabulary()
    # DeepSeek's VLChatProcessor looks <｜▁pad▁｜> up by name (their tokenizer_config.json names no pad token)
    deepseek = write_deepseek(tmp_path / "deepseek", reference)
    without_tokenizer_pad(deepseek)
    assert load_ar_model(deepseek).cfg.pad == vocab["<｜▁pad▁｜>"]
    # transformers' image generate takes the generation config's pad_token_id, else the text config's
    converted = write_converted(tmp_path / "converted", reference)
    without_tokenizer_pad(converted)
    assert load_ar_model(converted).cfg.pad == reference.config.text_config.pad_token_id == vocab["<｜▁pad▁｜>"]
    (converted / "generation_config.json").write_text(json.dumps({"pad_token_id": vocab["<unk>"]}))
    assert load_ar_model(converted).cfg.pad == vocab["<unk>"]
    # a tokenizer's special tokens: tokenizer_config.json, else special_tokens_map.json (as transformers reads them)
    (deepseek / "special_tokens_map.json").write_text(json.dumps({"pad_token": {"content": "<unk>"}, "bos_token": "a"}))
    assert special_token(deepseek, "pad_token") == "<unk>"
    assert special_token(deepseek, "bos_token") == "<｜begin▁of▁sentence｜>"  # tokenizer_config.json's comes first


def test_without_vq_the_cli_says_the_folder_holds_its_decoder_and_that_advice_works(reference, tmp_path):
    folder = write_converted(tmp_path / "tiny-janus", reference)
    args = ["generate", "--model", folder, "--prompt", "a dog", "--decoder", "ar", "--quiet", "--out", tmp_path / "x.png"]
    r = fastar(*args, cwd=tmp_path)
    assert r.returncode == 0 and "no images written" in r.stderr, r.stderr
    assert f"{folder} holds its own image decoder: give the same folder as --vq" in r.stderr
    r = fastar(*args, "--vq", folder, cwd=tmp_path)  # the advice followed
    assert r.returncode == 0, r.stderr
    assert Image.open(tmp_path / "x.png").size == (2 * GRID, 2 * GRID)  # the tiny VQ upsamples twice
