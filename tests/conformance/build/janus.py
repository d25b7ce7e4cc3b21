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
    VENV/bin/python tests/conformance/build/janus.py --layout deepseek --official /path/to/Janus
"""
from __future__ import annotations

import argparse
import contextlib
import shutil
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
FIXTURES = HERE.parent / "fixtures"
sys.path.insert(0, str(HERE.parent))  # common.save_image
from common import save_image  # noqa: E402
from provenance import packages, stub_torchvision, write_expected  # noqa: E402

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


def check_codes(codes: torch.Tensor) -> None:
    distinct = len(set(codes.flatten().tolist()))
    assert distinct >= 8, f"the greedy codes use only {distinct} distinct values: pick another seed"
    assert not torch.equal(codes[0], codes[1]), "both prompts gave the same codes"


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
    source = {"repository": "transformers", "commit": f"transformers {packages('transformers')['transformers']}",
              "packages": packages("torch", "transformers", "tokenizers"),
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

DEEPSEEK_ROLES = ("<|User|>", "<|Assistant|>")  # the Janus-Pro roles of DeepSeek's README and demo/app_januspro.py
TINY_SIGLIP = "siglip_tiny_patch4_24"  # the understanding tower (unused by generation), registered under this name
TINY_VQ = dict(ch=32, ch_mult=[1, 1], num_res_blocks=0, z_channels=32)  # 6 x 6 codes -> 12 x 12 pixels


def official_generate(official: Path):
    """``generate`` of the official generation_inference.py, compiled from that file (its module-level model
    loading from the hub and final call are not run)."""
    import ast

    source = (official / "generation_inference.py").read_text()
    tree = ast.parse(source)
    function = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "generate")
    namespace = {}
    imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    exec(compile(ast.Module(body=[*imports, function], type_ignores=[]), str(official / "generation_inference.py"),
                 "exec"), namespace)
    return namespace["generate"]


def build_deepseek(out: Path, seed: int, official: Path) -> None:
    import os
    import tempfile

    sys.path.insert(0, str(official))
    from transformers import LlamaTokenizerFast  # before the stand-in: transformers then knows it has no torchvision

    stub_torchvision()

    from janus.models import MultiModalityCausalLM, VLChatProcessor, VLMImageProcessor
    from janus.models import modeling_vlm, siglip_vit, vq_model

    # sizes the release's config cannot express: a tiny SigLIP registered by name, and a tiny VQ-16 made of the
    # official Encoder/Decoder (VQ_16 always builds the 384-px one, ch 128, whatever config.json says)
    siglip_vit.SigLIP_MODEL_CONFIG[TINY_SIGLIP] = dict(image_size=24, patch_size=4, width=16, layers=1, heads=2,
                                                      mlp_ratio=2, global_pool="map", use_checkpoint=False)

    def tiny_vq_16(**kwargs):
        model = vq_model.VQModel(vq_model.ModelArgs(codebook_size=CODES, encoder_ch_mult=TINY_VQ["ch_mult"],
                                                    decoder_ch_mult=TINY_VQ["ch_mult"], z_channels=TINY_VQ["z_channels"],
                                                    codebook_show_usage=False, **kwargs))
        model.encoder = vq_model.Encoder(**TINY_VQ)
        model.decoder = vq_model.Decoder(**TINY_VQ)
        return model

    vq_model.VQ_models["VQ-16"] = tiny_vq_16

    specials = [BOS, EOS, PAD, IMAGE, BOI, EOI]
    tokenizer = LlamaTokenizerFast(tokenizer_object=byte_level_tokenizer(specials), bos_token=BOS, eos_token=EOS,
                                   unk_token=None, add_bos_token=True, add_eos_token=False, model_max_length=16384,
                                   additional_special_tokens=[IMAGE, BOI, EOI])  # no pad token: looked up by name
    image_processor = VLMImageProcessor(image_size=24, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    processor = VLChatProcessor(image_processor=image_processor, tokenizer=tokenizer, num_image_tokens=GRID * GRID)
    assert tokenizer.pad_token is None and processor.pad_id == tokenizer.convert_tokens_to_ids(PAD)

    n_embed = 32
    config = modeling_vlm.MultiModalityConfig(
        vision_config={"cls": "CLIPVisionTower", "params": {"image_size": 24, "model_name": TINY_SIGLIP,
                                                            "select_feature": "same", "select_layer": -1},
                       "num_image_tokens": GRID * GRID},  # kept by VisionConfig's kwargs; the release says nothing
        aligner_config={"cls": "MlpProjector", "params": {"depth": 2, "input_dim": 16, "n_embed": n_embed,
                                                          "projector_type": "mlp_gelu"}},
        gen_vision_config={"cls": "VQ-16", "params": {"image_token_size": CODES, "n_embed": 8}},
        gen_aligner_config={"cls": "MlpProjector", "params": {"depth": 2, "input_dim": 8, "n_embed": n_embed,
                                                              "projector_type": "mlp_gelu"}},
        gen_head_config={"cls": "vision_head", "params": {"image_token_embed": n_embed, "image_token_size": CODES,
                                                          "n_embed": n_embed}},
        language_config={"hidden_size": n_embed, "intermediate_size": 64, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 256,
                         "rms_norm_eps": 1e-6, "vocab_size": len(tokenizer), "torch_dtype": "float32"},
        architectures=["MultiModalityCausalLM"], torch_dtype="float32")
    torch.manual_seed(seed)
    model = MultiModalityCausalLM(config).eval()
    randomise(model, seed)

    folder = out / "janus_deepseek"
    shutil.rmtree(folder, ignore_errors=True)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)

    # the official path, from the saved folder
    model = MultiModalityCausalLM.from_pretrained(folder).eval()
    processor = VLChatProcessor.from_pretrained(folder)
    generate = official_generate(official)
    codes, pixels = [], []
    decode_code = model.gen_vision_model.decode_code

    def recording_decode_code(code_b, shape=None, channel_first=True):
        codes.append(code_b.clone())
        pixels.append(decode_code(code_b, shape=shape, channel_first=channel_first))
        return pixels[-1]

    model.gen_vision_model.decode_code = recording_decode_code
    prompt_ids = []
    with tempfile.TemporaryDirectory() as scratch, contextlib.chdir(scratch), greedy_on_cpu():
        for text in PROMPTS:
            conversation = [{"role": DEEPSEEK_ROLES[0], "content": text}, {"role": DEEPSEEK_ROLES[1], "content": ""}]
            sft_format = processor.apply_sft_template_for_multi_turn_prompts(
                conversations=conversation, sft_format=processor.sft_format, system_prompt="")
            prompt = sft_format + processor.image_start_tag
            prompt_ids.append(processor.tokenizer.encode(prompt))
            generate(model, processor, prompt, parallel_size=1, cfg_weight=CFG,
                     image_token_num_per_image=GRID * GRID, img_size=2 * GRID, patch_size=2)
            assert os.path.exists("generated_samples/img_0.jpg")
    codes = torch.cat(codes).long()
    pixels = torch.cat(pixels)
    check_codes(codes)
    runs = [{"name": "greedy-cfg5", "args": [a for p in PROMPTS for a in ("--prompt", p)] + ["--cfg", str(CFG),
                                                                                            "--top-k", "1"],
             "prompt_ids": prompt_ids, "codes": codes.tolist(), "images": []}]
    for i, image in enumerate(pixels):
        name = f"greedy-cfg5_{i}.png"
        save_image(image.float().numpy(), folder / name)
        runs[0]["images"].append(name)
    commit = subprocess.run(["git", "-C", str(official), "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    source = {"repository": "deepseek-ai/Janus", "commit": commit,
              "packages": packages("torch", "transformers", "tokenizers", "timm", "attrdict", "einops"),
              "builder": "tests/conformance/build/janus.py --layout deepseek",
              "made_with": "janus.models MultiModalityCausalLM(MultiModalityConfig) random, norms randomised, "
                           "save_pretrained; VLChatProcessor(VLMImageProcessor, LlamaTokenizerFast byte-level BPE "
                           "without a pad token: pad_id is looked up by name).save_pretrained; from_pretrained of "
                           "both; prompt by apply_sft_template_for_multi_turn_prompts (roles <|User|>/<|Assistant|> "
                           "as the Janus-Pro README, system prompt '') + image_start_tag; generate() of "
                           "generation_inference.py compiled from the file and run once per prompt (parallel_size 1, "
                           "cfg_weight 5) with torch.multinomial replaced by argmax and Tensor.cuda a no-op; its "
                           "gen_vision_model.decode_code output recorded for the images. Sizes the release config "
                           "cannot express: VQ_models['VQ-16'] patched to a VQModel whose Encoder/Decoder are the "
                           "official classes at ch 32, ch_mult [1, 1], num_res_blocks 0, z 32, codebook_show_usage "
                           "off (the release also stores quantize.codebook_used, 65536 training counts, which FastAR "
                           "drops); the understanding SigLIP registered in SigLIP_MODEL_CONFIG at width 16, 1 layer. "
                           "config.json's vision_config carries num_image_tokens 36 (the release's has none: 576 = 24 x 24 is implied; "
                           "FastAR reads the grid from it). torchvision (used by janus for understanding-image preprocessing only) is a stand-in "
                           "module: PyPI's torchvision wheel needs CUDA's torch libraries"}
    write_expected(folder, source, runs)
    print(folder, sum(f.stat().st_size for f in folder.iterdir()), "bytes")


@contextlib.contextmanager
def greedy_on_cpu():
    """torch.multinomial -> argmax (greedy), Tensor.cuda -> itself, while the official loop runs."""
    multinomial, cuda = torch.multinomial, torch.Tensor.cuda
    torch.multinomial = lambda probs, num_samples, **kw: probs.argmax(-1, keepdim=True)
    torch.Tensor.cuda = lambda self, *a, **kw: self
    try:
        yield
    finally:
        torch.multinomial, torch.Tensor.cuda = multinomial, cuda



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
