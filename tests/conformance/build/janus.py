"""Builds the Janus-Pro conformance fixtures with the official code (run by hand, never by the tests).

``--layout transformers`` (run with FastAR's own venv, transformers 5.x): a tiny random
``JanusForConditionalGeneration`` saved by ``save_pretrained`` with its ``JanusProcessor`` (tokenizer, image processor,
chat template) as a converted release folder has them; the prompts go through the processor's chat template and
``processor(..., generation_mode="image")`` (left padding), the codes come from ``model.generate(...,
generation_mode="image", do_sample=False, guidance_scale=5)``, the images from ``model.decode_image_tokens``.

``--layout deepseek --official CHECKOUT`` (run with a venv that can import deepseek-ai/Janus: an older transformers,
attrdict, einops, timm): a tiny ``MultiModalityCausalLM`` built from its config classes and saved by
``save_pretrained`` with the tokenizer files DeepSeek's release has (tokenizer.json, tokenizer_config.json,
special_tokens_map.json, processor_config.json); the prompt through ``VLChatProcessor``'s sft template, then
``generation_inference.py``'s ``generate`` loop run as the official file has it (the file is executed with the model
loading and the final call stubbed, and ``.cuda()`` made a no-op), with ``torch.multinomial`` replaced by argmax, and
its ``gen_vision_model.decode_code`` for the images.

    python tests/conformance/build/janus.py --layout transformers
    /tmp/janus-venv/bin/python tests/conformance/build/janus.py --layout deepseek --official /path/to/Janus
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
FIXTURES = HERE.parent / "fixtures"
sys.path.insert(0, str(HERE.parent))  # common.save_image
from common import save_image  # noqa: E402

PROMPTS = ["a red ring on a blue background", "a dog"]  # different lengths: left padding in one batch
CFG = 5.0
GRID, CODES = 6, 64  # 6 x 6 image tokens of a 64-code book
BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
IMAGE, BOI, EOI = "<image_placeholder>", "<begin_of_image>", "<end_of_image>"
CORPUS = ["<|User|>: a red ring on a blue background\n\n<|Assistant|>:", "<|User|>: a dog\n\n<|Assistant|>:",
          "a blue square on a red background", "a green dog on a white ring", "an image of a cat and a dog"]


def byte_level_tokenizer(specials: list[str]):
    """A small byte-level BPE (the kind DeepSeek's LLM tokenizer is) that puts bos in front, as theirs does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                             special_tokens=[(BOS, tokenizer.token_to_id(BOS))])
    return tokenizer


def randomise(model, seed: int) -> None:
    """Norms away from their neutral init, matrices and embeddings at unit gain (the 0.02 init gives a greedy
    sampler that repeats one code), biases and any zero-initialised weight random, so that every part shows."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if "norm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.3 * noise)
            elif p.dim() == 2 and ("embed" in name or "embedding" in name):
                p.copy_(noise)
            elif p.dim() == 2:
                p.copy_(noise / p.shape[1] ** 0.5)
            elif p.abs().max() == 0:
                p.copy_(0.05 * noise)


def package_versions(*names) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return found


def check_codes(codes: torch.Tensor) -> None:
    distinct = len(set(codes.flatten().tolist()))
    assert distinct >= 8, f"the greedy codes use only {distinct} distinct values: pick another seed"
    assert not torch.equal(codes[0], codes[1]), "both prompts gave the same codes"


def write_expected(folder: Path, source: dict, runs: list) -> None:
    (folder / "expected.json").write_text(json.dumps({"source": source, "runs": runs}, indent=1, ensure_ascii=False)
                                          + "\n")


# ---------------------------------------------------------------- transformers' layout

def build_transformers(out: Path, seed: int) -> None:
    from transformers import (GenerationConfig, JanusConfig, JanusForConditionalGeneration, JanusImageProcessor,
                              JanusProcessor, PreTrainedTokenizerFast)

    specials = [BOS, EOS, PAD, IMAGE, BOI, EOI]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=byte_level_tokenizer(specials), bos_token=BOS, eos_token=EOS, pad_token=PAD,
        model_max_length=16384, extra_special_tokens={"image_token": IMAGE, "boi_token": BOI, "eoi_token": EOI})
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in specials}
    processor = JanusProcessor(image_processor=JanusImageProcessor(size={"height": 24, "width": 24}),
                               tokenizer=tokenizer, chat_template=CHAT_TEMPLATE, use_default_system_prompt=True,
                               num_image_tokens=GRID * GRID)
    config = JanusConfig(
        text_config=dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                         pad_token_id=ids[PAD], bos_token_id=ids[BOS], eos_token_id=ids[EOS]),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=24, patch_size=4, num_image_tokens=GRID * GRID, projection_dim=32),
        vq_config=dict(embed_dim=8, num_embeddings=CODES, latent_channels=32, base_channels=32,
                       channel_multiplier=[1, 1], num_res_blocks=0, num_patches=GRID, projection_dim=32,
                       image_token_embed_dim=32, num_hidden_layers=2),
        image_token_id=ids[IMAGE])
    torch.manual_seed(seed)
    model = JanusForConditionalGeneration(config).eval()
    randomise(model, seed)
    model.generation_config = GenerationConfig(
        bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD], guidance_scale=CFG,
        generation_kwargs={"boi_token_id": ids[BOI]})

    folder = out / "janus_transformers"
    shutil.rmtree(folder, ignore_errors=True)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)

    # the official path, from the saved folder as a user loads it
    model = JanusForConditionalGeneration.from_pretrained(folder).eval()
    processor = JanusProcessor.from_pretrained(folder)
    texts = [processor.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": p}]}],
                                           add_generation_prompt=True) for p in PROMPTS]
    inputs = processor(text=texts, generation_mode="image", padding=True, return_tensors="pt")
    assert (inputs["attention_mask"] == 0).any(), "the two prompts should differ in length (left padding)"
    with torch.no_grad():
        codes = model.generate(**inputs, generation_mode="image", do_sample=False, guidance_scale=CFG)
        check_codes(codes)
        pixels = model.decode_image_tokens(codes)  # [B, H, W, 3] in -1..1
    runs = [{"name": "greedy-cfg5", "args": [a for p in PROMPTS for a in ("--prompt", p)] + ["--cfg", str(CFG),
                                                                                            "--top-k", "1"],
             "prompt_ids": inputs["input_ids"].tolist(), "codes": codes.tolist(), "images": []}]
    for i, image in enumerate(pixels):
        name = f"greedy-cfg5_{i}.png"
        save_image(image.float().numpy(), folder / name)
        runs[0]["images"].append(name)
    source = {"repository": "transformers", "commit": f"transformers {package_versions('transformers')['transformers']}",
              "packages": package_versions("torch", "transformers", "tokenizers"),
              "builder": "tests/conformance/build/janus.py --layout transformers",
              "made_with": "JanusForConditionalGeneration(JanusConfig) random, norms randomised, save_pretrained; "
                           "JanusProcessor(PreTrainedTokenizerFast byte-level BPE, JanusImageProcessor, a chat "
                           "template rendering the release's user/assistant format).save_pretrained; from_pretrained of both; "
                           "processor.apply_chat_template + processor(generation_mode='image', padding=True); "
                           "model.generate(generation_mode='image', do_sample=False, guidance_scale=5); "
                           "model.decode_image_tokens"}
    write_expected(folder, source, runs)
    print(folder, sum(f.stat().st_size for f in folder.iterdir()), "bytes")


# A chat template of our own writing that renders a user turn as the converted releases' template does
# (``<|User|>: TEXT\n\n<|Assistant|>:`` with the generation prompt); only text turns are needed here. The newlines
# are an expression: chat templates render with trim_blocks, which would eat one after a block tag.
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] | lower == 'user' %}<|User|>: {% else %}"
                 "<|Assistant|>: {% endif %}{% for c in m['content'] %}{% if c['type'] == 'text' %}"
                 "{{ c['text'] | trim }}{% endif %}{% endfor %}{{ '\\n\\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}<|Assistant|>:{% endif %}")


# ---------------------------------------------------------------- DeepSeek's layout

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=["transformers", "deepseek"], required=True)
    parser.add_argument("--official", help="deepseek: a checkout of deepseek-ai/Janus")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=FIXTURES)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.layout == "transformers":
        build_transformers(args.out, args.seed)
    else:
        build_deepseek(args.out, args.seed, Path(args.official))


if __name__ == "__main__":
    main()
