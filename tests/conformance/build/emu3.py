"""Builds the Emu3 generation conformance fixtures with the official code (run by hand, never by the tests).

``--layout transformers`` (run with FastAR's own venv, transformers 5.x): a tiny random ``Emu3ForConditionalGeneration``
saved by ``save_pretrained`` with its ``Emu3Processor`` (a byte-level BPE tokenizer with the release's special tokens
and 64 visual tokens, an ``Emu3ImageProcessor``), as the converted release folder has them. The prompts go through
the processor with ``return_for_image_generation=True`` (left padding, an image area and a ratio: a 4 x 5 grid), the
negative prompt too (BAAI's rule: it carries the same image header; transformers' doc example leaves the header out);
the codes come from ``model.generate`` with transformers' own CFG (``guidance_scale`` 3 with ``negative_prompt_ids``:
``UnbatchedClassifierFreeGuidanceLogitsProcessor`` on the whole vocabulary's log-probabilities, first) and
``prefix_allowed_tokens_fn`` (the layout: a row end after every row, then ``<|extra_201|>``, ``<|image end|>``, eos),
greedy; the images from ``model.decode_image_tokens`` and the processor's ``postprocess``.

``--layout baai --official CHECKOUT`` (run with transformers 4.44 and tiktoken, as BAAI's requirements.txt pins
them, e.g. ``pip install --target SITE --no-deps transformers==4.44.0 tokenizers==0.19.1 huggingface_hub==0.24.7
tiktoken requests urllib3 idna certifi charset_normalizer regex`` and ``PYTHONPATH=SITE`` with FastAR's venv for torch):
a tiny random ``Emu3ForCausalLM`` (baaivision/Emu3's emu3/mllm) saved by ``save_pretrained`` with its
``Emu3Tokenizer`` (a tiny tiktoken rank file, the vision tokens file: ``save_pretrained``) and, in ``VisionTokenizer/``,
a tiny ``Emu3VisionVQModel`` with its ``Emu3VisionVQImageProcessor``; then BAAI's ``image_generation.py`` itself is
run (its prompts with the quality suffix, ratios 1:1 and 16:9 in one batch, CFG 3 against its negative prompt,
``UnbatchedClassifierFreeGuidanceLogitsProcessor`` then ``PrefixConstrainedLogitsProcessor``, top-k 2048), with its
hub loaders returning the tiny models (fp32), "cuda:0" read as "cpu" and ``torch.multinomial`` as argmax (greedy;
top-k 2048 keeps all 64 codes); its ``processor.decode`` writes the images.

    python tests/conformance/build/emu3.py --layout transformers
    PYTHONPATH=SITE python tests/conformance/build/emu3.py --layout baai --official /path/to/Emu3
"""
from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
FIXTURES = HERE.parent / "fixtures"
sys.path.insert(0, str(HERE.parent))
from provenance import COMMITS, commit_of, packages, write_expected  # noqa: E402
from janus import greedy_on_cpu, randomise  # noqa: E402 - build/janus.py: argmax sampling; weights off their init

PROMPTS = ["a red ring on a blue background", "a dog"]  # different lengths: left padding in one batch
NEGATIVE = ("lowres, bad anatomy, bad hands, text, error, missing fingers, extra digit, fewer digits, cropped, worst "
            "quality, low quality, normal quality, jpeg artifacts, signature, watermark, username, blurry.")  # BAAI's
OWN_NEGATIVE = "a blurry green square"  # a negative prompt given on the command line
CFG = 3.0
SIZE, RATIO = 36, "5:4"  # an area of 36 x 36 px at width:height 5:4 -> 4 rows x 5 columns of 8-px tokens
CODES = 64
PAD, BOS, EOS = "<|endoftext|>", "<|extra_203|>", "<|extra_204|>"
ROW_END, EOF = "<|extra_200|>", "<|extra_201|>"
BOI, IMAGE_WRAPPER, EOI, IMAGE = "<|image start|>", "<|image token|>", "<|image end|>", "<image>"
CORPUS = [*PROMPTS, NEGATIVE, OWN_NEGATIVE, "a blue square on a red background", "a green dog on a white ring",
          "an image of a cat and a dog", "0 1 2 3 4 5 6 7 8 9 * 10*10 90*90"]
# image decoder normalisation: neither the class defaults (CLIP's) nor 0.5, so that a decoder reading either is caught
MEAN, STD = [0.45, 0.5, 0.55], [0.55, 0.5, 0.45]


def visual(k: int) -> str:
    return f"<|visual token {k:06d}|>"


def emu3_tokenizer(seed: int):
    """A small byte-level BPE with Emu3's special tokens (no bos added: the processor writes it) and the visual tokens
    registered in a shuffled order, so that code k's id is no offset of k (the vocabulary map says which)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = [PAD, ROW_END, EOF, BOS, EOS, IMAGE_WRAPPER, BOI, EOI, IMAGE]
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    order = torch.randperm(CODES, generator=torch.Generator().manual_seed(seed)).tolist()
    tokenizer.add_special_tokens([visual(k) for k in order])
    return tokenizer


def tiny_config(tokenizer):
    from transformers import Emu3Config

    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in (PAD, BOS, EOS)}
    return Emu3Config(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=512,
                         pad_token_id=ids[PAD], bos_token_id=ids[BOS], eos_token_id=ids[EOS],
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        vq_config=dict(codebook_size=CODES, embed_dim=4, latent_channels=4, base_channels=32,
                       channel_multiplier=[1, 1, 1, 1], num_res_blocks=1, attn_resolutions=[3], hidden_size=32,
                       temporal_downsample_factor=4),
        vocabulary_map=tokenizer.get_vocab())


def randomise_statistics(model, seed: int) -> None:
    """The VQ decoder's BatchNorm running statistics away from 0 and 1 (they are used in eval mode)."""
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("running_mean"):
                buffer.copy_(0.2 * torch.randn(buffer.shape, generator=generator))
            elif name.endswith("running_var"):
                buffer.copy_(0.5 + torch.rand(buffer.shape, generator=generator))


def layout_fn(tokenizer, height: int, width: int, visual_ids: list[int]):
    """The prefix-constrained rule of BAAI's ``Emu3PrefixConstrainedLogitsHelper`` and transformers' doc example
    (written here from its facts): counted from ``<|image token|>``, a row end after every ``width`` image tokens (the
    last row's too), then ``<|extra_201|>``, ``<|image end|>``, eos, then padding."""
    wrapper, row_end, eof, eoi, eos, pad = (tokenizer.convert_tokens_to_ids(t)
                                            for t in (IMAGE_WRAPPER, ROW_END, EOF, EOI, EOS, PAD))

    def allowed(batch_id, input_ids):
        offset = input_ids.shape[0] - int(torch.nonzero(input_ids == wrapper)[0, 0])
        end = (width + 1) * height
        if offset % (width + 1) == 0:
            return [row_end]
        return {end + 1: [eof], end + 2: [eoi], end + 3: [eos]}.get(offset, [pad] if offset > end + 3 else visual_ids)

    return allowed


def greedy_margin(scores, rows: list[int]) -> float:
    """The smallest gap between the best and second-best processed score over the image-token steps ``rows``."""
    margins = []
    for step in rows:
        top = scores[step].float().topk(2, dim=-1).values
        margins.append((top[:, 0] - top[:, 1]).min().item())
    return min(margins)


def build_transformers(out: Path, seed: int) -> None:
    from transformers import (Emu3ForConditionalGeneration, Emu3ImageProcessor, Emu3Processor, GenerationConfig,
                              PreTrainedTokenizerFast)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=emu3_tokenizer(seed), bos_token=BOS, eos_token=EOS, pad_token=PAD, padding_side="left",
        model_max_length=9216, extra_special_tokens={"image_token": IMAGE, "boi_token": BOI, "eoi_token": EOI,
                                                     "image_wrapper_token": IMAGE_WRAPPER, "eof_token": EOF})
    processor = Emu3Processor(image_processor=Emu3ImageProcessor(image_mean=MEAN, image_std=STD), tokenizer=tokenizer)
    config = tiny_config(tokenizer)
    torch.manual_seed(seed)
    model = Emu3ForConditionalGeneration(config).eval()
    randomise(model, seed)
    randomise_statistics(model, seed)
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in (PAD, BOS, EOS)}
    model.generation_config = GenerationConfig(bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD])

    folder = out / "emu3_hf"
    shutil.rmtree(folder, ignore_errors=True)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)  # transformers 5: processor_config.json, the image processor's settings inside
    processor.image_processor.save_pretrained(folder)  # preprocessor_config.json, as the release folder has it

    # the official path, from the saved folder as a user loads it
    model = Emu3ForConditionalGeneration.from_pretrained(folder).eval()
    processor = Emu3Processor.from_pretrained(folder)
    image = dict(return_for_image_generation=True, ratio=RATIO, image_area=SIZE * SIZE, return_tensors="pt")
    inputs = processor(text=PROMPTS, padding=True, **image)
    assert (inputs["attention_mask"] == 0).any(), "the two prompts should differ in length (left padding)"
    height, width = (int(v) for v in inputs.pop("image_sizes")[0])
    assert (height, width) == (4, 5), (height, width)
    visual_ids = model.vocabulary_mapping.image_tokens
    steps = height * (width + 1) + 3
    image_steps = [t for t in range(height * (width + 1)) if (t + 1) % (width + 1)]
    runs = []
    for name, negative, args in (("greedy-cfg3", NEGATIVE, []),
                                 ("greedy-cfg3-negative", OWN_NEGATIVE, ["--negative-prompt", OWN_NEGATIVE])):
        negatives = processor(text=[negative] * len(PROMPTS), padding=True, **image)
        negatives.pop("image_sizes")
        assert (negatives["attention_mask"] == 1).all()
        with torch.no_grad():
            out = model.generate(**inputs, do_sample=False, guidance_scale=CFG, max_new_tokens=steps,
                                 negative_prompt_ids=negatives["input_ids"],
                                 negative_prompt_attention_mask=negatives["attention_mask"],
                                 prefix_allowed_tokens_fn=layout_fn(tokenizer, height, width, visual_ids),
                                 return_dict_in_generate=True, output_scores=True)
            generated = out.sequences[:, inputs["input_ids"].shape[1]:]
            assert generated.shape[1] == steps, generated.shape
            pixels = model.decode_image_tokens(image_tokens=generated, height=height, width=width)
        codes = model.vocabulary_mapping.convert_bpe2img(generated[:, :-3].reshape(-1, height, width + 1))
        codes = codes.reshape(len(PROMPTS), -1).long()
        check(codes, generated, tokenizer, height, width)
        margin = greedy_margin(out.scores, image_steps)
        assert margin > 1e-3, f"{name}: a greedy choice is within {margin:.2e} of a tie: pick another seed"
        run = {"name": name, "args": [a for p in PROMPTS for a in ("--prompt", p)] + args + [
                   "--cfg", str(CFG), "--top-k", "1", "--image-size", str(SIZE), "--aspect-ratio", RATIO],
               "prompt_ids": inputs["input_ids"].tolist(), "negative_ids": negatives["input_ids"].tolist(),
               "rows": unpadded(inputs) + unpadded(negatives),
               "sequences": generated.tolist(), "codes": codes.tolist(), "greedy_margin": margin, "images": []}
        for i, picture in enumerate(processor.postprocess(list(pixels.float()), return_tensors="PIL.Image.Image")
                                    ["pixel_values"]):
            run["images"].append(f"{name}_{i}.png")
            picture.save(folder / run["images"][-1])
        runs.append(run)
    assert runs[0]["codes"] != runs[1]["codes"], "the negative prompt does not steer the codes"
    source = {"repository": "transformers", "commit": f"transformers {packages('transformers')['transformers']}",
              "packages": packages("torch", "transformers", "tokenizers"),
              "builder": "tests/conformance/build/emu3.py --layout transformers",
              "made_with": "Emu3ForConditionalGeneration(Emu3Config) random (weights at unit gain, norms and BatchNorm "
                           "statistics randomised), save_pretrained; Emu3Processor(PreTrainedTokenizerFast byte-level "
                           "BPE with Emu3's special tokens and 64 visual tokens registered in a shuffled order, "
                           "Emu3ImageProcessor(image_mean, image_std not the defaults)).save_pretrained, and the "
                           "image processor's preprocessor_config.json as the release folder has it; "
                           "from_pretrained of both; processor(return_for_image_generation=True, ratio='5:4', "
                           "image_area=36*36, padding=True) for the prompts and for the negative prompt (BAAI's "
                           "image_generation.py: the negative prompt carries the same image header; transformers' "
                           "doc example leaves it out); model.generate(do_sample=False, guidance_scale=3, "
                           "negative_prompt_ids, prefix_allowed_tokens_fn = the layout rule of BAAI's "
                           "Emu3PrefixConstrainedLogitsHelper), both prompts in one batch (left padding); "
                           "vocabulary_mapping.convert_bpe2img for the codes; model.decode_image_tokens + "
                           "processor.postprocess (PIL) for the images. Runs: BAAI's published negative prompt (what "
                           "FastAR uses when none is given) and one given with --negative-prompt"}
    write_expected(folder, source, runs)
    print(folder, sum(f.stat().st_size for f in folder.iterdir()), "bytes")


def unpadded(batch) -> list[list[int]]:
    """Each row's tokens without its left padding."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]


def check(codes: torch.Tensor, generated: torch.Tensor, tokenizer, height: int, width: int) -> None:
    """The official output has the layout (row ends, the closing tokens) and codes worth comparing."""
    row_end, eof, eoi, eos = (tokenizer.convert_tokens_to_ids(t) for t in (ROW_END, EOF, EOI, EOS))
    rows = generated[:, :-3].reshape(len(generated), height, width + 1)
    assert (rows[..., -1] == row_end).all() and (generated[:, -3:] == torch.tensor([eof, eoi, eos])).all()
    distinct = len(set(codes.flatten().tolist()))
    assert distinct >= 8, f"the greedy codes use only {distinct} distinct values: pick another seed"
    assert not torch.equal(codes[0], codes[1]), "both prompts gave the same codes"


# ---------------------------------------------------------------- BAAI's layout

BAAI_PROMPTS = ["a portrait of young girl.", "a shiba inu"]  # image_generation.py's, with its POSITIVE_PROMPT
BAAI_SUFFIX = " masterpiece, film grained, best quality."
BAAI_RATIOS = ["1:1", "16:9"]  # its ratios: 4 x 4 (round(4.5) is 4) and 3 x 6 tokens at an area of 36 x 36 px
BAAI_VISION = ["<|image token|>", "<|image start|>", "<|image end|>"]  # the vision tokens file's first lines
TOKENIZER_SAMPLES = ["a portrait of young girl. masterpiece, film grained, best quality.", "It's 12345 dogs!\n\n  ok",
                     "caf\u00e9 cafe\u0301 \u4e2d\u6587 \U0001F600", "x<|image start|>4*4<|image token|>y",
                     "  a   b\t\tc \r\n", "we'LL SEE: don't-stop", "\u00c5ngstr\u00f6m \u212b"]


def tiktoken_ranks(seed: int) -> dict[bytes, int]:
    """A tiny tiktoken rank table: the 256 bytes (ranked in a shuffled order, so that a byte's id is not its value)
    and the merges a byte-level BPE learns from the corpus, each ranked after its parts."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    learner.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(
        vocab_size=380, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    to_byte = {c: b for b, c in byte_chars().items()}
    ranks = {bytes([b]): r for b, r in enumerate(torch.randperm(256, generator=torch.Generator().manual_seed(seed)).tolist())}
    for a, b in (m.split(" ") if isinstance(m, str) else m for m in json_merges(learner)):
        token = bytes(to_byte[c] for c in a + b)
        ranks.setdefault(token, len(ranks))
    return ranks


def byte_chars() -> dict[int, str]:
    from fastar.model_loaders.shared.tokenizing import byte_level_names  # the same table as GPT-2's

    return byte_level_names()


def json_merges(tokenizer) -> list:
    import json

    return json.loads(tokenizer.to_str())["model"]["merges"]


def build_baai(out: Path, seed: int, official: Path) -> None:
    import base64
    import contextlib
    import os
    import tempfile

    import types

    import transformers

    package = types.ModuleType("emu3")  # the checkout's emu3/ (no __init__.py): this builder's own name shadows it
    package.__path__ = [str(official / "emu3")]
    sys.modules["emu3"] = package
    from emu3.mllm import tokenization_emu3
    from emu3.mllm.configuration_emu3 import Emu3Config as BaaiConfig
    from emu3.mllm.modeling_emu3 import Emu3ForCausalLM
    from emu3.tokenizer.configuration_emu3visionvq import Emu3VisionVQConfig
    from emu3.tokenizer.image_processing_emu3visionvq import Emu3VisionVQImageProcessor
    from emu3.tokenizer.modeling_emu3visionvq import Emu3VisionVQModel

    folder = out / "emu3_baai"
    shutil.rmtree(folder, ignore_errors=True)
    scratch = Path(tempfile.mkdtemp())
    ranks = tiktoken_ranks(seed)
    (scratch / "emu3.tiktoken").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    (scratch / "emu3_vision_tokens.txt").write_text("\n".join(BAAI_VISION + [visual(k) for k in range(CODES)]) + "\n")
    # the one departure a tiny vocabulary forces: BAAI's tokenizer numbers its special tokens from 151643, the size of
    # Qwen's rank file, which its own check (ranks + special tokens = vocabulary) makes the number of ranks
    tokenization_emu3.SPECIAL_START_ID = len(ranks)
    tokenizer = tokenization_emu3.Emu3Tokenizer(str(scratch / "emu3.tiktoken"), str(scratch / "emu3_vision_tokens.txt"))
    tokenizer.save_pretrained(folder)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (PAD, BOS, EOS, ROW_END, EOF, *BAAI_VISION)}
    config = BaaiConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, pad_token_id=ids[PAD], bos_token_id=ids[BOS],
        eos_token_id=ids[EOS], img_token_id=ids[IMAGE_WRAPPER], boi_token_id=ids[BOI], eoi_token_id=ids[EOI],
        eol_token_id=ids[ROW_END], eof_token_id=ids[EOF], image_area=SIZE * SIZE, architectures=["Emu3ForCausalLM"],
        attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = Emu3ForCausalLM(config).eval()
    randomise(model, seed)
    model.save_pretrained(folder)
    vq_config = Emu3VisionVQConfig(codebook_size=CODES, embed_dim=4, z_channels=4, ch=32, ch_mult=[1, 1, 1, 1],
                                   num_res_blocks=1, attn_resolutions=[3], temporal_downsample_factor=4)
    vq = Emu3VisionVQModel(vq_config).eval()
    randomise(vq, seed + 2)
    randomise_statistics(vq, seed + 2)
    vq.save_pretrained(folder / "VisionTokenizer")
    Emu3VisionVQImageProcessor(image_mean=MEAN, image_std=STD).save_pretrained(folder / "VisionTokenizer")

    # BAAI's image_generation.py as it stands, its hub loads answered by the tiny models from the saved folders
    loads = {
        (transformers.AutoModelForCausalLM, "BAAI/Emu3-Gen"): lambda: Emu3ForCausalLM.from_pretrained(
            folder, attn_implementation="sdpa").eval(),
        (transformers.AutoTokenizer, "BAAI/Emu3-Gen"): lambda: tokenization_emu3.Emu3Tokenizer.from_pretrained(
            folder, padding_side="left"),
        (transformers.AutoImageProcessor, "BAAI/Emu3-VisionTokenizer"):
            lambda: Emu3VisionVQImageProcessor.from_pretrained(folder / "VisionTokenizer"),
        (transformers.AutoModel, "BAAI/Emu3-VisionTokenizer"):
            lambda: Emu3VisionVQModel.from_pretrained(folder / "VisionTokenizer").eval(),
    }
    script = (official / "image_generation.py").read_text().replace('"cuda:0"', '"cpu"')
    namespace = {"__name__": "image_generation"}
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as run_dir, contextlib.chdir(run_dir):
        for (cls, hub), load in loads.items():
            stack.enter_context(replaced(cls, hub, load))
        stack.enter_context(greedy_on_cpu())
        exec(compile(script, str(official / "image_generation.py"), "exec"), namespace)
        outputs, pos, neg = namespace["outputs"], namespace["pos_inputs"], namespace["neg_inputs"]
        for i in range(len(BAAI_PROMPTS)):  # result_{row}_{chunk}.png: the decoded text's image chunk
            image, = Path(run_dir).glob(f"result_{i}_*.png")
            shutil.copy(image, folder / f"image_generation_{i}.png")
    first_visual = tokenizer.convert_tokens_to_ids(visual(0))
    prompt_len = pos.input_ids.shape[1]
    runs = []
    for i, (prompt, ratio) in enumerate(zip(BAAI_PROMPTS, BAAI_RATIOS)):
        h, w = (int(v) for v in pos.image_size[i])
        generated = outputs[i, prompt_len:].tolist()[: h * (w + 1) + 3]
        codes = [t - first_visual for t in generated if first_visual <= t < first_visual + CODES]
        assert len(codes) == h * w and generated[-3:] == [ids[EOF], ids[EOI], ids[EOS]], (h, w, generated)
        assert len(set(codes)) >= 6, f"the greedy codes use only {len(set(codes))} values: pick another seed"
        rows = [batch.input_ids[i][batch.attention_mask[i].bool()].tolist() for batch in (pos, neg)]
        runs.append({"name": f"image_generation_{i}", "grid": [h, w],
                     "args": ["--prompt", prompt + BAAI_SUFFIX, "--cfg", "3.0", "--top-k", "1", "--aspect-ratio", ratio],
                     "rows": rows, "sequences": [generated], "codes": [codes],
                     "images": [f"image_generation_{i}.png"]})
    samples = {text: tokenizer.encode(text) for text in [*TOKENIZER_SAMPLES, *CORPUS]}
    source = {"repository": "baaivision/Emu3", "commit": commit_of(official),
              "packages": packages("torch", "transformers", "tokenizers", "tiktoken"),
              "builder": "tests/conformance/build/emu3.py --layout baai",
              "tokenizer_samples": samples,
              "made_with": "emu3.mllm Emu3ForCausalLM(Emu3Config, image_area 36*36) random (weights at unit gain, norms "
                           "randomised), save_pretrained; Emu3Tokenizer over a tiny tiktoken rank file (256 bytes "
                           "ranked in a shuffled order, then a byte-level BPE's merges learnt from a small corpus) and "
                           "the vision tokens file (<|image token|>, <|image start|>, <|image end|>, 64 visual "
                           "tokens), save_pretrained, with tokenization_emu3.SPECIAL_START_ID set to the number of "
                           "ranks (151643 in the release: the ranks of Qwen's file); VisionTokenizer/: "
                           "emu3.tokenizer Emu3VisionVQModel (ch 32, ch_mult [1, 1, 1, 1], 64 codes) random with "
                           "BatchNorm statistics randomised, save_pretrained, and Emu3VisionVQImageProcessor(mean, "
                           "std not the release's).save_pretrained; then image_generation.py executed as it stands "
                           "(its two prompts + POSITIVE_PROMPT, ratios 1:1 and 16:9 in one left-padded batch, "
                           "image_area from config.json, CFG 3 against NEGATIVE_PROMPT carrying the same image "
                           "header, UnbatchedClassifierFreeGuidanceLogitsProcessor then PrefixConstrainedLogitsProcessor, "
                           "top-k 2048) with its from_pretrained calls answered by these folders (fp32, sdpa, no "
                           "flash-attn), \"cuda:0\" read as \"cpu\" and torch.multinomial as argmax; its "
                           "processor.decode wrote the images. FastAR draws each row in a run of its own (its grid is "
                           "one per model); tokenizer_samples: texts and the ids Emu3Tokenizer (tiktoken) gives them"}
    write_expected(folder, source, runs)
    print(folder, sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()), "bytes")


@contextlib.contextmanager
def replaced(cls, hub: str, load):
    """``cls.from_pretrained(hub, ...)`` answered by ``load()`` while the official script runs."""
    original = cls.from_pretrained

    def from_pretrained(name, *args, **kwargs):
        return load() if name == hub else original(name, *args, **kwargs)

    cls.from_pretrained = from_pretrained
    try:
        yield
    finally:
        cls.from_pretrained = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=["transformers", "baai"], required=True)
    parser.add_argument("--official", help="baai: a checkout of baaivision/Emu3")
    parser.add_argument("--commit", help="baai: the checkout's commit, where it has no .git")
    parser.add_argument("--seed", type=int, help="default: 0 (transformers), 1 (baai: seed 0 gives a 2-code image)")
    parser.add_argument("--out", type=Path, default=FIXTURES)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.layout == "transformers":
        build_transformers(args.out, 0 if args.seed is None else args.seed)
    else:
        if args.commit:
            COMMITS[Path(args.official).resolve()] = args.commit
        build_baai(args.out, 1 if args.seed is None else args.seed, Path(args.official))


if __name__ == "__main__":
    main()
