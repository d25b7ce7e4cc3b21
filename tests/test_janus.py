"""The Janus adapter against transformers' JanusForConditionalGeneration on a tiny random model, loaded from
both folder layouts (transformers' conversion and DeepSeek's original): teacher-forced image logits of cond
rows and CFG's padded uncond rows, greedy decoding against transformers' own image ``generate``, and the VQ
decode inside the folder against transformers' ``JanusVQVAE.decode``."""
import pytest
import torch

from fastar.model_loaders import load_ar_model, load_image_decoder
from fastar.model_loaders.protocol import PromptConditioning
from fastar.samplers.jacobi import ar_decode
from fastar.samplers.processing import SamplingSettings
from fastar.tests.tiny_janus import CODES, GRID, hf_model, vocabulary, write_converted, write_deepseek

PROMPTS = ["a red ring on a blue background", "a dog"]


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
