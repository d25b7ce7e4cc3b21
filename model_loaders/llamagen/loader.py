"""Loading LlamaGen checkpoints: the GPT (official or HF-renamed keys) and its VQ tokenizer.

The GPT's config comes from FastAR's ``fastar_config`` metadata when present, otherwise from the weight
shapes plus what was saved beside them (training args, a config.json). Rules for what shapes cannot say:
- heads: ``n_head``/``num_attention_heads`` from the args or config, else the official size table
  (by ``args.gpt_model`` or by layers and width); KV heads then follow from the ``wqkv`` shape;
- image size (the block size is not in the weights): an explicit choice, else ``image_size`` /
  ``downsample_size`` from the training args, else the config (``image_size``, or a square ``block_size``),
  else the size in an official file name (``c2i_L_384.pt``: 384 px), else 256 px with a warning.
"""
from __future__ import annotations

import math
import re
import warnings
from collections.abc import Mapping

import torch

from ...errors import FastARError, FastARWarning
from ..shared.building import (build_and_load, checkpoint_of, config_from_metadata, first_setting, official_heads,
                               weight_shape, where_config_goes)
from ..shared.checkpoint import AR_MODEL, IMAGE_DECODER, CheckpointInfo, has_prefix, require_family
from .model import LlamaGenConfig, LlamaGenGPT
from .vq import VQConfig, VQModel

# The official GPT_models table: name -> (n_layer, dim, n_head).
OFFICIAL_SIZES = {
    "GPT-B": (12, 768, 12), "GPT-L": (24, 1024, 16), "GPT-XL": (36, 1280, 20), "GPT-XXL": (48, 1536, 24),
    "GPT-XXXL": (48, 2560, 40), "GPT-1B": (22, 2048, 32), "GPT-3B": (24, 3200, 32), "GPT-7B": (32, 4096, 32),
}
DEFAULT_IMAGE_SIZE = 256  # the official ModelArgs' block size, 256 tokens: 256 px at downsample 16
DOWNSAMPLE = 16  # pixels per token side of every released LlamaGen GPT (VQ-16)
SIZE_IN_NAME = re.compile(r"_(256|384|512)(?=[_.\-]|$)")  # c2i_XL_384.pt, t2i_XL_stage2_512.pt
SIZE_HINT = "choose the image size (--image-size, or image_size on FastAR Load AR Model)"
DEFAULT_CAPTION_TOKENS = 120

# LANTERN's HF re-packaging of LlamaGen: same math, LLaMA names (q/k/v are fused separately).
HF_RENAMES = tuple((re.compile(pattern), official) for pattern, official in (
    (r"model\.embed_tokens\.", "tok_embeddings."),
    (r"model\.cls_embedding\.", "cls_embedding."),
    (r"model\.norm\.", "norm."),
    (r"lm_head\.", "output."),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.", r"layers.\1.attention.wo."),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.", r"layers.\1.feed_forward.w1."),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.", r"layers.\1.feed_forward.w3."),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.", r"layers.\1.feed_forward.w2."),
    (r"model\.layers\.(\d+)\.input_layernorm\.", r"layers.\1.attention_norm."),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.", r"layers.\1.ffn_norm."),
))
HF_QKV = re.compile(r"model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.weight")


def load_llamagen(path_or_state_dict, *, image_size: int | None = None, device="cpu", dtype=torch.float32,
                  info: CheckpointInfo | None = None) -> LlamaGenGPT:
    """A LlamaGen GPT (c2i or t2i) in eval mode without gradients. ``image_size`` (pixels, square) overrides
    the saved size; ``info`` comes with an already read state dict."""
    sd, info = checkpoint_of(path_or_state_dict, info)
    if require_family(sd, info.source, AR_MODEL) == "llamagen-gpt-hf":
        sd = official_key_names(sd, info.source)
    cfg = llamagen_config(sd, info, image_size)
    return build_and_load(LlamaGenGPT, cfg, sd, info.source, device, dtype)


def load_vq(path_or_state_dict, *, device="cpu", dtype=torch.float32,
            info: CheckpointInfo | None = None) -> VQModel:
    """A LlamaGen VQ tokenizer in eval mode: decoder only, unless the file has encoder weights."""
    sd, info = checkpoint_of(path_or_state_dict, info)
    require_family(sd, info.source, IMAGE_DECODER)
    sd = {k: v for k, v in sd.items() if k != "quantize.codebook_used"}  # training statistics
    return build_and_load(VQModel, vq_config(sd, info), sd, info.source, device, dtype)


# -- configs -------------------------------------------------------------------------------------


def saved_config(config_class, info: CheckpointInfo, image_size: int | None):
    """The config FastAR saved with its own files (``image_size`` overriding its grid), or None."""
    saved = info.fastar_config()
    if saved is None:
        return None
    cfg = config_from_metadata(config_class, saved, info.source)
    if image_size is not None:
        cfg.grid = grid_for(image_size, cfg.downsample, info.source)
    return cfg


def vq_config(sd, info: CheckpointInfo) -> VQConfig:
    saved = info.fastar_config()
    if saved is not None:
        cfg = config_from_metadata(VQConfig, saved, info.source)
        cfg.with_encoder = has_prefix(sd, "encoder.")
        return cfg
    try:
        return VQConfig.from_state_dict(sd)
    except KeyError as e:
        raise FastARError(f"{info.source}: the VQ tokenizer has no {e} weight: the file is incomplete, "
                          "re-download it") from e


def llamagen_config(sd, info: CheckpointInfo, image_size: int | None = None) -> LlamaGenConfig:
    """The config of a LlamaGen GPT state dict with official key names (rules in the module doc)."""
    saved = saved_config(LlamaGenConfig, info, image_size)
    if saved is not None:
        return saved
    settings, source = info.settings(), info.source
    vocab_size, dim = weight_shape(sd, "tok_embeddings.weight", source)
    n_layer = 1 + max(int(m.group(1)) for k in sd if (m := re.match(r"layers\.(\d+)\.", k)))
    n_head = head_count(n_layer, dim, settings, source)
    qkv_rows = weight_shape(sd, "layers.0.attention.wqkv.weight", source)[0]
    downsample = int(first_setting(settings, ("downsample_size",), DOWNSAMPLE))
    common = dict(
        dim=dim, n_layer=n_layer, n_head=n_head, vocab_size=vocab_size,
        n_kv_head=(qkv_rows // (dim // n_head) - n_head) // 2,
        ffn_hidden=weight_shape(sd, "layers.0.feed_forward.w1.weight", source)[0],
        grid=grid_of(info, image_size, downsample), downsample=downsample,
        norm_eps=float(first_setting(settings, ("norm_eps", "rms_norm_eps"), 1e-5)),
        rope_base=float(first_setting(settings, ("rope_base", "rope_theta"), 10000.0)),
    )
    if "cls_embedding.embedding_table.weight" in sd:
        rows = sd["cls_embedding.embedding_table.weight"].shape[0]
        return LlamaGenConfig(model_type="c2i", num_classes=rows - 1, cls_token_num=1, **common)
    if "cls_embedding.cap_proj.fc1.weight" in sd:
        null = sd.get("cls_embedding.uncond_embedding")
        tokens = null.shape[0] if null is not None else int(settings.get("cls_token_num", DEFAULT_CAPTION_TOKENS))
        caption_dim = sd["cls_embedding.cap_proj.fc1.weight"].shape[1]
        return LlamaGenConfig(model_type="t2i", caption_dim=caption_dim, cls_token_num=tokens, **common)
    raise FastARError(
        f"{source} has no conditioning embedding (cls_embedding.embedding_table for class-to-image or "
        "cls_embedding.cap_proj for text-to-image): the file is incomplete or not a LlamaGen GPT"
    )


def head_count(n_layer: int, dim: int, settings: dict, source: str) -> int:
    """Attention heads: from the config/args, else the official size table."""
    n_head = first_setting(settings, ("n_head", "num_attention_heads"), None)
    if n_head is not None:
        return int(n_head)
    name = settings.get("gpt_model")
    heads = official_heads(OFFICIAL_SIZES, name, (n_layer, dim))
    if heads is not None:
        return heads
    said = f" (its args name {name})" if name else ""
    raise FastARError(
        f"{source}: cannot tell the number of attention heads of a {n_layer}-layer, {dim}-wide LlamaGen "
        f"model{said}: it is none of the official sizes ({', '.join(OFFICIAL_SIZES)}) and no config says. "
        f'{where_config_goes(source)}: {{"num_attention_heads": N}}'
    )


def grid_of(info: CheckpointInfo, image_size: int | None, downsample: int) -> tuple[int, int]:
    """The image token grid: see the module doc for the order of the rules."""
    source = info.source
    if image_size is not None:
        return grid_for(image_size, downsample, source)
    for settings, where in ((info.args or {}, "training args"), (info.config or {}, "config")):
        if settings.get("image_size"):
            return grid_for(int(settings["image_size"]), downsample, f"{source} ({where})")
        if settings.get("block_size"):
            side = math.isqrt(int(settings["block_size"]))
            if side * side != int(settings["block_size"]):
                raise FastARError(f"{source}: the block size in its {where} ({settings['block_size']} tokens) is not "
                                  f"a square grid, so the image size is unknown: {SIZE_HINT}")
            return side, side
    named = SIZE_IN_NAME.search(source)
    if named:
        return grid_for(int(named.group(1)), downsample, source)
    side = DEFAULT_IMAGE_SIZE // downsample
    warnings.warn(f"{source}: nothing says its image size (no training args, config or size in the file name); "
                  f"using {DEFAULT_IMAGE_SIZE} px ({side}x{side} tokens). If it was trained at another size, "
                  f"{SIZE_HINT}", FastARWarning, stacklevel=2)
    return side, side


def grid_for(image_size: int, downsample: int, source: str) -> tuple[int, int]:
    """Tokens per side of a square image of ``image_size`` pixels."""
    if image_size <= 0 or image_size % downsample:
        raise FastARError(f"{source}: image size {image_size} px is not a positive multiple of the model's "
                          f"{downsample}-pixel tokens: use e.g. {downsample * 16}, {downsample * 24} or {downsample * 32}")
    side = image_size // downsample
    return side, side


# -- HF names --------------------------------------------------------------------------------------


def official_key_names(sd: Mapping[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """LANTERN's HF-named LlamaGen state dict under the official names (q, k, v fused into wqkv)."""
    renamed, qkv = {}, {}
    for key, tensor in sd.items():
        if m := HF_QKV.fullmatch(key):
            qkv.setdefault(int(m.group(1)), {})[m.group(2)] = tensor
        else:
            renamed[hf_to_official(key)] = tensor
    for layer, parts in sorted(qkv.items()):
        missing = [p for p in "qkv" if p not in parts]
        if missing:
            raise FastARError(f"{source}: layer {layer} has no {'/'.join(missing)} projection: the file is "
                              "incomplete (a shard missing?), re-download it")
        renamed[f"layers.{layer}.attention.wqkv.weight"] = torch.cat([parts["q"], parts["k"], parts["v"]])
    return renamed


def hf_to_official(key: str) -> str:
    for pattern, official in HF_RENAMES:
        if m := pattern.match(key):
            return m.expand(official) + key[m.end():]
    return key
