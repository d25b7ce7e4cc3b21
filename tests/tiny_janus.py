"""Tiny Janus folders for tests: a random transformers JanusForConditionalGeneration saved in transformers'
layout, or renamed to DeepSeek's original layout, with a word-level tokenizer made with ``tokenizers``."""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from fastar.tests.tiny_chameleon import randomise_norms, save_tokenizer

CODES, GRID = 48, 6  # 6 x 6 image tokens
WORDS = ["a", "red", "blue", "ring", "square", "on", "background", ":", "dog"]


def vocabulary() -> dict[str, int]:
    names = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<unk>", "<|User|>", "<|Assistant|>",
             "<begin_of_image>", "<end_of_image>", "<image_placeholder>", *WORDS]
    return {name: i for i, name in enumerate(names)}


def hf_model(seed: int = 0):
    from transformers import JanusConfig, JanusForConditionalGeneration

    vocab = vocabulary()
    config = JanusConfig(
        text_config=dict(model_type="llama", vocab_size=len(vocab) + 3, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                         pad_token_id=vocab["<｜▁pad▁｜>"], bos_token_id=0),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=24, patch_size=4, num_image_tokens=GRID * GRID, projection_dim=64),
        vq_config=dict(embed_dim=8, num_embeddings=CODES, latent_channels=32, base_channels=32,
                       channel_multiplier=[1, 2], num_res_blocks=1, projection_dim=64, image_token_embed_dim=64,
                       num_hidden_layers=2),
        image_token_id=vocab["<image_placeholder>"])
    torch.manual_seed(seed)
    model = JanusForConditionalGeneration(config).eval()
    randomise_norms(model, seed)
    return model


def write_tokenizer(folder: Path) -> None:
    save_tokenizer(folder, vocabulary(), bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", pad="<｜▁pad▁｜>")


def write_converted(folder: Path, model) -> Path:
    """transformers' layout: config.json as the model saves it, ``model.*`` weights."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model.config.to_dict()))
    save_file({k: v.clone() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))  # lm_head is tied
    write_tokenizer(folder)
    return folder


# transformers' names -> DeepSeek's original ones (the reverse of the loader's renaming, written independently)
TO_DEEPSEEK = (
    (r"^model\.language_model\.", "language_model.model."),
    (r"^lm_head\.", "language_model.lm_head."),
    (r"^model\.generation_embeddings\.", "gen_embed."),
    (r"^model\.generation_aligner\.fc1\.", "gen_aligner.layers.0."),
    (r"^model\.generation_aligner\.hidden_layers\.0\.", "gen_aligner.layers.2."),
    (r"^model\.generation_head\.proj_out\.", "gen_head.output_mlp_projector."),
    (r"^model\.generation_head\.vision_head\.", "gen_head.vision_head."),
    (r"^model\.vision_model\.", "vision_model."),
    (r"^model\.aligner\.", "aligner."),
)
# JanusVQVAE -> LlamaGen's VQ names (what DeepSeek's gen_vision_model holds)
VQ_TO_LLAMAGEN = (
    (r"\.(down|up)\.(\d+)\.block\.", r".conv_blocks.\2.res."),
    (r"\.(down|up)\.(\d+)\.", r".conv_blocks.\2."),
    (r"\.mid\.block_1\.", ".mid.0."), (r"\.mid\.attn_1\.", ".mid.1."), (r"\.mid\.block_2\.", ".mid.2."),
)


def deepseek_key(key: str) -> str:
    if key.startswith("model.vqmodel."):
        key = "gen_vision_model." + key[len("model.vqmodel."):]
        for pattern, new in VQ_TO_LLAMAGEN:
            key = re.sub(pattern, new, key, count=1)
        return key
    for pattern, new in TO_DEEPSEEK:
        if re.match(pattern, key):
            return re.sub(pattern, new, key, count=1)
    raise KeyError(key)


def write_deepseek(folder: Path, model) -> Path:
    """DeepSeek's original layout: ``language_config`` and friends in config.json, their weight names."""
    folder.mkdir(parents=True, exist_ok=True)
    text = model.config.text_config.to_dict()
    config = {"architectures": ["MultiModalityCausalLM"], "model_type": "multi_modality", "language_config": text,
              "gen_head_config": {"params": {"image_token_embed": 64, "image_token_size": CODES, "n_embed": 64}},
              "gen_aligner_config": {"params": {"depth": 2, "input_dim": 8, "n_embed": 64}},
              "vision_config": {"num_image_tokens": GRID * GRID}}  # the release's says nothing: 24 x 24 there
    (folder / "config.json").write_text(json.dumps(config))
    save_file({deepseek_key(k): v.clone() for k, v in model.state_dict().items()},
              str(folder / "model.safetensors"))
    write_tokenizer(folder)
    return folder
