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

    python tests/conformance/build/emu3.py --layout transformers
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
FIXTURES = HERE.parent / "fixtures"
sys.path.insert(0, str(HERE.parent))
from provenance import packages, write_expected  # noqa: E402
from janus import randomise  # noqa: E402 - build/janus.py: every weight away from its neutral init

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=["transformers"], required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=FIXTURES)
    args = parser.parse_args()
    torch.set_num_threads(1)
    build_transformers(args.out, args.seed)


if __name__ == "__main__":
    main()
