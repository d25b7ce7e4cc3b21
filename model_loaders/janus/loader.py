"""Loading Janus / Janus-Pro (1B, 7B) from Hugging Face folders: DeepSeek's original layout
(``language_model.model.*``, ``gen_embed``, ``gen_aligner.layers.{0,2}``, ``gen_head.output_mlp_projector``,
``gen_vision_model.*``) and transformers' conversion (``model.language_model.*``, ``model.generation_*``,
``model.vqmodel.*``). Only the generation path is loaded (the understanding encoder is left out).

Prompt: ``<|User|>: {prompt}\\n\\n<|Assistant|>:<begin_of_image>`` after bos (DeepSeek's sft format with an
empty system prompt, as their generation script builds it); 384 px = 24 x 24 tokens of the LlamaGen VQ-16
decoder inside the checkpoint (``load_image_decoder`` on the folder finds it).
"""
from __future__ import annotations

import re

import torch

from ...errors import FastARError
from ..shared.tokenizing import load_tokenizer, token_id
from ..shared.checkpoint import CheckpointInfo, load_weights, read_json, renamed, select, shape_of
from .model import JanusConfig, JanusGPT
from ..shared.llm_decoder import DecoderConfig
from ..shared.protocol import PromptConditioning
from ..shared.tokenizing import encode_text

TEMPLATE = "<|User|>: {prompt}\n\n<|Assistant|>:"
BOI = "<begin_of_image>"
DEEPSEEK_PAD = "<｜▁pad▁｜>"  # the name VLChatProcessor looks the pad token up by
IMAGE_SIZE, TOKEN = 384, 16

# original DeepSeek names -> the internal (transformers-converted) ones; None: not part of generation
DEEPSEEK_NAMES = (
    (re.compile(r"^language_model\.model\."), "language_model."),
    (re.compile(r"^gen_aligner\.layers\.0\."), "gen_aligner.fc1."),
    (re.compile(r"^gen_aligner\.layers\.(\d+)\."), lambda m: f"gen_aligner.hidden_layers.{int(m.group(1)) // 2 - 1}."),
    (re.compile(r"^gen_head\.output_mlp_projector\."), "gen_head.proj_out."),
    (re.compile(r"^(language_model\.lm_head|vision_model|aligner|gen_vision_model)\."), None),
)
CONVERTED_NAMES = (
    (re.compile(r"^model\.language_model\."), "language_model."),
    (re.compile(r"^model\.generation_embeddings\."), "gen_embed."),
    (re.compile(r"^model\.generation_aligner\."), "gen_aligner."),
    (re.compile(r"^model\.generation_head\."), "gen_head."),
    (re.compile(r"^(lm_head|model\.vision_model|model\.aligner|model\.vqmodel)\."), None),
)


def is_converted(sd) -> bool:
    return any(k.startswith("model.generation_head.") for k in sd)


def internal_names(sd: dict) -> dict:
    """The generation path's weights under the internal names (either layout)."""
    return renamed(sd, CONVERTED_NAMES if is_converted(sd) else DEEPSEEK_NAMES)


# transformers' JanusVQVAE (LDM-style names, levels from the lowest resolution up) -> LlamaGen's VQ names
CONVERTED_VQ_NAMES = tuple((re.compile(p), r) for p, r in (
    (r"^(encoder|decoder)\.(down|up)\.(\d+)\.block\.", r"\1.conv_blocks.\3.res."),
    (r"^(encoder|decoder)\.(down|up)\.(\d+)\.", r"\1.conv_blocks.\3."),
    (r"^(encoder|decoder)\.mid\.block_1\.", r"\1.mid.0."),
    (r"^(encoder|decoder)\.mid\.attn_1\.", r"\1.mid.1."),
    (r"^(encoder|decoder)\.mid\.block_2\.", r"\1.mid.2."),
))


def vq_of_janus(sd: dict, converted: bool) -> dict:
    """The VQ-16 decoder inside a Janus folder (``model.vqmodel.*`` converted, ``gen_vision_model.*``
    original), under LlamaGen's VQ key names."""
    prefix = "model.vqmodel." if converted else "gen_vision_model."
    inner = select(sd, {k[len(prefix):]: k for k in sd if k.startswith(prefix)})
    return renamed(inner, CONVERTED_VQ_NAMES) if converted else inner


def llm_settings(config: dict) -> dict:
    """The LLM's config: ``text_config`` (converted) or ``language_config`` (DeepSeek)."""
    return config.get("text_config") or config.get("language_config") or {}


class JanusPrompts:
    """Prompts -> token ids with the model's tokenizer and DeepSeek's generation template."""

    def __init__(self, tokenizer, bos: int | None, boi: int):
        self.tokenizer, self.bos, self.boi = tokenizer, bos, boi

    def encode(self, conditioning) -> list[list[int]]:
        if not isinstance(conditioning, PromptConditioning):
            raise FastARError("this is a text-to-image model: give it prompts (--prompt, or FastAR Text Conditioning)")
        ids = []
        for prompt in conditioning.prompts:
            tokens = encode_text(self.tokenizer, TEMPLATE.format(prompt=prompt))
            ids.append(([self.bos] if self.bos is not None else []) + tokens + [self.boi])
        return ids


def special_token(folder, name: str) -> str | None:
    """A special token's name (``pad_token``, ``bos_token``) as transformers' tokenizers read it:
    tokenizer_config.json, else special_tokens_map.json (DeepSeek's releases keep the pad token there only)."""
    for file in ("tokenizer_config.json", "special_tokens_map.json"):
        value = (read_json(folder / file) or {}).get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if value:
            return value
    return None


def pad_token(folder, config: dict, tokenizer, converted: bool) -> int | None:
    """The token CFG's unconditional prompt is made of, as the official sampler of the folder's layout finds it.
    transformers' image ``generate`` uses the generation config's pad_token_id (generation_config.json, else the
    text config's); DeepSeek's ``VLChatProcessor.pad_id`` looks ``<｜▁pad▁｜>`` up by name in the vocabulary.
    Either falls back on the tokenizer's own pad token."""
    if converted:
        for settings in (read_json(folder / "generation_config.json") or {}, llm_settings(config)):
            if isinstance(settings.get("pad_token_id"), int):
                return settings["pad_token_id"]
    elif tokenizer.token_to_id(DEEPSEEK_PAD) is not None:
        return tokenizer.token_to_id(DEEPSEEK_PAD)
    name = special_token(folder, "pad_token")
    return tokenizer.token_to_id(name) if name else None


def load_janus(sd, *, info: CheckpointInfo, image_size: int | None = None, device="cpu",
               dtype=torch.float32) -> JanusGPT:
    """A Janus model from its HF folder, with its tokenizer; the grid is the release's (24 x 24)."""
    if image_size is not None and image_size != IMAGE_SIZE:
        raise FastARError(f"{info.source} is a Janus model, which draws {IMAGE_SIZE} px images only")
    config, folder = info.config or {}, info.folder
    if folder is None or not config:
        raise FastARError(f"{info.source}: a Janus model is read from its Hugging Face folder (config.json, "
                          "weights, tokenizer files): pick the folder, not a single file (FastAR's docs/models.md)")
    tokenizer = load_tokenizer(folder, info.source)
    weights = internal_names(sd)
    llm = llm_settings(config)
    heads = llm.get("num_attention_heads")
    if heads is None:
        raise FastARError(f"{info.source}: config.json does not give the LLM's num_attention_heads (text_config or "
                          "language_config): re-download the model's config.json")
    layers = len({k.split(".")[2] for k in weights if k.startswith("language_model.layers.")})
    tokens = (config.get("vision_config") or {}).get("num_image_tokens", (IMAGE_SIZE // TOKEN) ** 2)
    side = int(round(tokens ** 0.5))
    vocab, hidden = shape_of(weights, "language_model.embed_tokens.weight")
    k_proj = shape_of(weights, "language_model.layers.0.self_attn.k_proj.weight")
    decoder = DecoderConfig(
        hidden_size=hidden, n_layer=layers, n_head=heads, n_kv_head=k_proj[0] // (hidden // heads),
        ffn_hidden=shape_of(weights, "language_model.layers.0.mlp.gate_proj.weight")[0], vocab_size=vocab,
        rope_theta=float((llm.get("rope_parameters") or {}).get("rope_theta", llm.get("rope_theta", 10000.0))),
        rms_eps=llm.get("rms_norm_eps", 1e-6))
    pad = pad_token(folder, config, tokenizer, is_converted(sd))
    if pad is None:
        raise FastARError(f"{info.source}: no pad token found (generation_config.json, tokenizer_config.json, "
                          f"special_tokens_map.json, or {DEEPSEEK_PAD} in tokenizer.json), which CFG's unconditional "
                          "prompt is made of: copy all of the model's json files from its release into the folder "
                          "(FastAR's docs/models.md)")
    bos_name = special_token(folder, "bos_token")
    cfg = JanusConfig(
        decoder=decoder, codes=shape_of(weights, "gen_embed.weight")[0], code_width=shape_of(weights, "gen_embed.weight")[1],
        aligner_layers=1 + len({k for k in weights if k.startswith("gen_aligner.hidden_layers.") and k.endswith(".weight")}),
        head_width=shape_of(weights, "gen_head.proj_out.weight")[0], grid=(side, side), pad=pad,
        bos=tokenizer.token_to_id(bos_name) if bos_name else None, boi=token_id(tokenizer, BOI, info.source))
    with torch.device("meta"):
        model = JanusGPT(cfg, JanusPrompts(tokenizer, cfg.bos, cfg.boi))
    load_weights(model, weights, info.source, device, dtype)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)
