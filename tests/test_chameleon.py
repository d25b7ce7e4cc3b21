"""The Chameleon-family adapter against an implementation nobody here wrote: transformers'
ChameleonForConditionalGeneration, on tiny random models saved as HF folders (tests/tiny_chameleon.py).

- teacher-forced image-code logits of cond rows (prompt + image prefix) and CFG's uncond rows (from boi), for
  prompts of different lengths in one batch, rows at different positions, windows that cross row ends;
- greedy decoding with CFG against a reference loop over the transformers model that forces the row-end and
  eoi tokens as Lumina-mGPT's logits processor does: the whole written sequence must be the same;
- the code <-> vocabulary mapping is read from the vocabulary map (the tiny vocabulary scrambles it).
"""
import pytest
import torch

from fastar.errors import FastARError
from fastar.model_loaders import load_ar_model
from fastar.model_loaders.shared.protocol import PromptConditioning
from fastar.model_loaders.shared.tokenizing import encode_text
from fastar.samplers.token_loops.jacobi import ar_decode
from fastar.samplers.processing import SamplingSettings
from fastar.tests.tiny_chameleon import CODES, code_name, hf_model, vocabulary, write_folder

PROMPTS = ["a red ring on a blue background", "a green square"]


@pytest.fixture(scope="module")
def reference():
    return hf_model(seed=0)


@pytest.fixture(scope="module", params=["lumina", "anole"])
def folder(request, reference, tmp_path_factory):
    lumina = request.param == "lumina"
    path = tmp_path_factory.mktemp("chameleon") / ("tiny-lumina-mgpt" if lumina else "tiny-anole")
    return write_folder(path, reference, lumina=lumina, image_size=128 if lumina else None)


@pytest.fixture(scope="module")
def model(folder):
    return load_ar_model(folder)


def image_ids(model) -> list[int]:
    vocab = vocabulary()
    return [vocab[code_name(k)] for k in range(CODES)]


def written(model, prefix: list[int], codes: list[int]) -> list[int]:
    """The vocabulary ids the model reads for ``prefix`` then image codes (row ends inserted)."""
    cfg, ids = model.cfg, image_ids(model)
    seq = list(prefix)
    for p, code in enumerate(codes):
        seq.append(ids[code])
        if cfg.row_end is not None and (p + 1) % cfg.grid[1] == 0:
            seq.append(cfg.row_end)
    return seq


@torch.no_grad()
def reference_image_logits(reference, model, prefix: list[int], codes: list[int]) -> torch.Tensor:
    """[N, CODES]: transformers' logits for every image token given the ones before it (the stock forward
    blanks image logits, so the output head is applied to its hidden states)."""
    seq = written(model, prefix, codes)
    logits = reference.lm_head(reference.model(torch.tensor([seq])).last_hidden_state)[0]
    # image token p sits after the prefix, p tokens and the row ends before it; its logits come one earlier
    w, ends = model.cfg.grid[1], model.cfg.row_end is not None
    slots = [len(prefix) + p + (p // w if ends else 0) - 1 for p in range(len(codes))]
    return logits[slots][:, image_ids(model)]


def test_the_code_mapping_is_read_from_the_vocabulary_map(model):
    assert model.cfg.image_ids == image_ids(model) and model.cfg.image_ids != sorted(model.cfg.image_ids)
    assert model.vocab_size == CODES and model.grid == ((8, 8) if model.cfg.row_end else (32, 32))


def test_teacher_forced_logits_equal_transformers(model, reference):
    N = model.grid[0] * model.grid[1]
    codes = torch.randint(0, CODES, (2, N), generator=torch.Generator().manual_seed(1))
    prompts = model.prompts.encode(PromptConditioning(PROMPTS))
    assert len(prompts[0]) != len(prompts[1])  # left padding is exercised
    session = model.start(PromptConditioning(PROMPTS), cfg=True, max_window=5)
    got = {(kind, b): {0: out[b, 0]} for kind, out in (("cond", session.first.cond), ("uncond", session.first.uncond))
           for b in range(2)}
    starts, steps = torch.tensor([0, 0]), [(3, 2), (5, 4), (2, 5), (4, 1)]  # rows advance differently
    call = 0
    while bool((starts < N - 1).any()):
        width = max(steps[call % len(steps)])
        window = torch.stack([codes[b, (starts[b] + torch.arange(width)).clamp(max=N - 1)] for b in range(2)])
        out = session.forward(window, starts)
        for b in range(2):
            for j in range(width):
                position = int(starts[b]) + j + 1
                if position < N:
                    got[("cond", b)][position] = out.cond[b, j]
                    got[("uncond", b)][position] = out.uncond[b, j]
            starts[b] = min(N - 1, int(starts[b]) + steps[call % len(steps)][b])
        call += 1
    for b in range(2):
        for kind, prefix in (("cond", prompts[b] + model.cfg.image_prefix), ("uncond", model.cfg.uncond_prefix)):
            expected = reference_image_logits(reference, model, prefix, codes[b].tolist())
            ours = torch.stack([got[(kind, b)][p] for p in range(N)])
            assert torch.allclose(ours, expected, atol=2e-5, rtol=1e-4), (kind, b, (ours - expected).abs().max())


@torch.no_grad()
def reference_greedy(reference, model, prompt: list[int], cfg_scale: float) -> list[int]:
    """Lumina-mGPT's decoding loop over transformers: CFG on the logits (the uncond context: boi, after bos for Anole),
    row ends and eoi forced where the layout puts them, image tokens otherwise; greedy."""
    cfg, ids = model.cfg, torch.tensor(image_ids(model))
    cond, uncond = prompt + cfg.image_prefix, list(cfg.uncond_prefix)
    w, N = cfg.grid[1], cfg.num_tokens
    written_codes = 0
    while True:
        layout = len(cond) - len(prompt) - len(cfg.image_prefix)  # tokens written after the prefix
        if cfg.row_end is not None and (layout + 1) % (w + 1) == 0:  # the last row too ends with one
            nxt = cfg.row_end
        elif written_codes == N:
            nxt = cfg.eoi
        else:
            def last(seq):
                return reference.lm_head(reference.model(torch.tensor([seq])).last_hidden_state)[0, -1]
            c, u = last(cond), last(uncond)
            guided = cfg_scale * (c - u) + u
            nxt = int(ids[guided[ids].argmax()])
            written_codes += 1
        cond.append(nxt)
        uncond.append(nxt)
        if nxt == cfg.eoi:
            return cond[len(prompt):]


def test_greedy_decoding_writes_the_same_sequence_as_transformers(model, reference):
    if model.cfg.row_end is None:
        pytest.skip("the Anole layout has 1024 tokens: its logits are pinned above, the loop runs on Lumina's")
    conditioning = PromptConditioning(PROMPTS[:1])
    codes, _ = ar_decode(model, conditioning, SamplingSettings(cfg_scale=3.0, temperature=0.0),
                         generator=torch.Generator())
    prompt = model.prompts.encode(conditioning)[0]
    expected = reference_greedy(reference, model, prompt, 3.0)
    assert model.image_sequence(codes[0]) == expected
    assert expected.count(model.cfg.row_end) == model.grid[0] and expected[-1] == model.cfg.eoi


def test_the_command_line_draws_from_prompts_with_every_token_decoder(folder, tmp_path):
    import json
    import subprocess
    import sys

    from fastar.model_loaders.chameleon.vqgan import VQGAN
    from fastar.model_loaders.shared.ldm_blocks import VQGANConfig

    if "anole" in folder.name:
        pytest.skip("one layout is enough for the command line")
    vqgan = tmp_path / "vqgan.ckpt"
    torch.manual_seed(0)
    torch.save({"state_dict": VQGAN(VQGANConfig(codebook_size=CODES, embed_dim=8, z_channels=32, ch=32,
                                                ch_mult=(1, 2), num_res_blocks=1)).state_dict()}, vqgan)

    def fastar(*args):
        return subprocess.run([sys.executable, "-m", "fastar", "generate", "--model", folder, "--vq", vqgan,
                               *map(str, args)], capture_output=True, text=True, timeout=600)

    for decoder in ("ar", "sjd", "gsd"):
        r = fastar("--prompt", "a red ring", "--prompt", "a green square", "--decoder", decoder, "--cfg", 3,
                   "--top-k", 10, "--out", tmp_path / f"{decoder}.png", "--stats-out", tmp_path / f"{decoder}.json")
        assert r.returncode == 0, r.stderr
        stats = json.loads((tmp_path / f"{decoder}.json").read_text())
        assert stats["decoder"] == decoder and stats["tokens"] == 64 and stats["batch"] == 2
        assert (tmp_path / f"{decoder}_1.png").exists()
    r = fastar("--class", 3)
    assert r.returncode == 2 and "text-to-image model: give --prompt" in r.stderr


def test_the_training_forward_equals_transformers(model, reference):
    """Teacher forcing without a cache (what the text demo trains with): left-padded rows give the logits of
    unpadded runs."""
    N = model.grid[0] * model.grid[1]
    codes = torch.randint(0, CODES, (2, N), generator=torch.Generator().manual_seed(4))
    prompts = model.prompts.encode(PromptConditioning(PROMPTS))
    rows = [written(model, p + model.cfg.image_prefix, c.tolist()) for p, c in zip(prompts, codes)]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    valid = torch.arange(width)[None] >= torch.tensor([[width - len(r)] for r in rows])
    with torch.no_grad():
        hidden = model.backbone.teacher_forced(model.backbone.embed_tokens(ids), valid)
        for b, r in enumerate(rows):
            expected = reference.lm_head(reference.model(torch.tensor([r])).last_hidden_state)[0, :, model.cfg.image_ids]
            assert torch.allclose(model.image_logits(hidden[b, width - len(r):]), expected, atol=2e-5, rtol=1e-4)


def test_the_loaded_output_head_keeps_only_the_image_rows(model, reference):
    """Sliced once at load (not gathered at every forward; the text rows are 0.45 GB at 7B), the same logits."""
    assert model.lm_head.weight.shape == (model.vocab_size, model.cfg.hidden_size) and model.image_rows_only
    hidden = torch.randn(3, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    expected = reference.lm_head(hidden)[:, model.cfg.image_ids]
    assert torch.allclose(model.image_logits(hidden), expected, atol=1e-6)


def test_lumina_shapes_are_the_releases_size_list():
    """Lumina-mGPT's generate_crop_size_list((S // 32) ** 2, 32), as its demo offers them (width x height)."""
    from fastar.model_loaders.chameleon.loader import lumina_shape, lumina_shapes

    assert lumina_shapes(128) == [(256, 64), (224, 64), (192, 64), (160, 64), (160, 96), (128, 96), (128, 128),
                                  (96, 128), (96, 160), (64, 160), (64, 192), (64, 224), (64, 256)]
    assert len(lumina_shapes(768)) == 73 and (1024, 576) in lumina_shapes(768) and (768, 768) in lumina_shapes(768)
    assert lumina_shape(768, "16:9") == (576, 1024) and lumina_shape(768, "9:16") == (1024, 576)  # (height, width)
    assert lumina_shape(1024, "4:3") == (864, 1152) and lumina_shape(512, "2:1") == (352, 704)
    assert lumina_shape(768, None) == lumina_shape(768, "1:1") == lumina_shape(768, "2:2") == (768, 768)
    with pytest.raises(FastARError, match="aspect ratio 4:3: Lumina-mGPT at 768 px .* are 4:1, 47:12, .* 16:9, "):
        lumina_shape(768, "4:3")


@pytest.mark.filterwarnings("ignore:the model's tokenizer does not know")  # the tiny vocabulary has no "128x96"
def test_lumina_aspect_ratio_sets_prompt_size_tokens_and_grid(folder):
    """Height first in the size tokens (its item processor writes them so, its layout processor reads them so),
    width x height in the prompt, the grid (height / 16, width / 16); Anole draws squares only."""
    from fastar.model_loaders.chameleon.loader import size_token

    if "anole" in folder.name:
        with pytest.raises(FastARError, match="draws square images"):
            load_ar_model(folder, aspect_ratio="4:3")
        assert load_ar_model(folder, aspect_ratio="1:1").cfg.grid == (32, 32)
        return
    vocab = vocabulary()
    wide = load_ar_model(folder, aspect_ratio="4:3")  # 128 px: 128 x 96
    assert wide.cfg.grid == (6, 8) and wide.cfg.size_ids == [vocab[size_token(3)], vocab[size_token(4)]]
    tall = load_ar_model(folder, aspect_ratio="2:5")  # 64 x 160
    assert tall.cfg.grid == (10, 4) and tall.cfg.size_ids == [vocab[size_token(5)], vocab[size_token(2)]]
    text = "Generate an image of 128x96 according to the following prompt:\na red ring<reserved08706>"
    written = wide.prompts.encode(PromptConditioning(["a red ring"]))
    assert written == [[wide.prompts.bos] + encode_text(wide.prompts.tokenizer, text)]


def test_token_pixels_read_from_either_name_of_the_level_multipliers():
    """transformers' configs say channel_multiplier, the 2024 Chameleon configs ch_mult: both give 16 px tokens."""
    from fastar.model_loaders.chameleon.loader import token_pixels

    for name in ("channel_multiplier", "ch_mult"):
        assert token_pixels({"vq_config": {name: [1, 1, 2, 2, 4]}}) == 16
        assert token_pixels({"vq_config": {name: [1, 2, 4]}}) == 4
    assert token_pixels({}) == 16  # no vq_config: Chameleon's VQGAN


@pytest.mark.parametrize("dtype,tolerance", [(torch.bfloat16, 0.1), (torch.float16, 0.01)], ids=["bf16", "fp16"])
def test_qk_norms_stored_per_shard_run_in_half_precision(dtype, tolerance):
    """The Lumina-mGPT layout whose QK norms are stored per model-parallel shard (``[1, head_dim]``, the
    conformance fixture saved by the official classes), loaded in bf16 and fp16 as a GPU user's ``auto`` does
    (emulated on the CPU): cond and uncond logits within half precision's rounding of fp32's (measured 0.04 and
    0.004 of a logit standard deviation of 1.0)."""
    from pathlib import Path

    folder = Path(__file__).resolve().parent / "conformance" / "fixtures" / "lumina_mgpt"

    def logits(dtype):
        model = load_ar_model(folder, dtype=dtype)
        assert model.decoder_cfg.qk_norm_rows == (1, 1)  # the per-shard layout, one shard
        session = model.start(PromptConditioning(PROMPTS[:1]), cfg=True, max_window=4)
        out = session.forward(torch.tensor([[5, 9, 100, 7]]), torch.tensor([3]))
        return out.cond.float(), out.uncond.float()

    (cond, uncond), (half_cond, half_uncond) = logits(torch.float32), logits(dtype)
    scale = cond.std()
    assert (half_cond - cond).abs().max() <= tolerance * scale and (half_uncond - uncond).abs().max() <= tolerance * scale
