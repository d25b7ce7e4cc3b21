"""Loading Chameleon-family models (Lumina-mGPT, Anole) from Hugging Face folders, with their tokenizer.

A folder holds ``config.json`` (sizes, ``vocabulary_map``), the weights (sharded safetensors with their
index, or one file) and the tokenizer (``tokenizer.json``, ``tokenizer_config.json``); nothing is fetched.
- Image code k is the vocabulary entry named ``IMGIMG<k in letters A-J>Z`` (``IMGIMGBAZ`` is code 10): the
  mapping is read, never assumed to be an offset.
- Lumina-mGPT (its folders say ``ChameleonXLLMXForConditionalGeneration``): prompt ``Generate an image of
  {W}x{H} according to the following prompt:\\n{prompt}`` and the turn separator ``<reserved08706>`` after
  bos; the image is ``<racm3:break>``, the height and width in 32-pixel units (``<reserved08800+n>``), rows
  of image tokens each ended by ``<reserved08799>``, then ``<eoss>``. 16-pixel tokens: 768 px is 48 x 48.
  The released models draw 512, 768 or 1024 px (the folder name says which); the size is the explicit
  choice, else config.json's ``image_size`` (FastAR's own models), else the folder name, else 768.
  Non-square images (an aspect ratio W:H): the release's shapes for size S are those of
  ``generate_crop_size_list((S // 32) ** 2, 32)`` (its data/item_processor.py, which its demo offers): for each
  width in 32-pixel units the most rows that keep the units' product within (S / 32)^2, sides at most 4:1 apart;
  a ratio picks the shape whose sides have it exactly (``lumina_shapes``), the others are refused.
- Anole (and Chameleon): the prompt after bos, the turn separator ``<reserved08706>``, then ``<racm3:break>``,
  32 x 32 image tokens (512 px), no row or size tokens; CFG's unconditional row is bos, ``<racm3:break>`` (as in
  GAIR-NLP/anole, transformers' ChameleonProcessor and LANTERN's Anole generate).
- The per-head QK norms are stored per head (``[heads, head_dim]``, transformers' conversion) or per
  model-parallel shard (``[shards, head_dim]``, ``[1, 128]`` for the 7B folders Lumina-mGPT's own classes save);
  both load.
The image decoder is Meta's VQGAN (``vqgan.ckpt``, a Lightning checkpoint); a folder's ``model.vqmodel.*``
weights serve when they include the decoder (transformers' Chameleon conversion keeps only the encoder).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from math import gcd
from pathlib import Path

import torch

from ...errors import FastARError
from ..shared.building import parse_ratio
from .model import ChameleonConfig, ChameleonGPT
from ..shared.checkpoint import IMAGE_DECODER, CheckpointInfo, load_weights, read_json, require_family, select, shape_of
from ..shared.protocol import PromptConditioning
from ..shared.ldm_blocks import VQGANConfig
from ..shared.tokenizing import encode_text, load_tokenizer, token_id
from .vqgan import VQGAN

BOI, EOI, ROW_END, TURN_END = "<racm3:break>", "<eoss>", "<reserved08799>", "<reserved08706>"
IMAGE_NAME = re.compile(r"^IMGIMG([A-J]+)Z$")
LUMINA_TEMPLATE = "Generate an image of {w}x{h} according to the following prompt:\n{prompt}"
LUMINA_SIZES = (512, 768, 1024)  # the released models'
LUMINA_DEFAULT_SIZE = 768
PATCH = 32  # Lumina-mGPT's size tokens count 32-pixel units
TOKEN = 16  # pixels per image token side of Chameleon's VQGAN (config.json's vq_config can say otherwise)
ANOLE_SIZE = 512


def size_token(units: int) -> str:
    return f"<reserved{8800 + units:05d}>"


def image_codes(vocabulary_map: dict, source: str) -> list[int]:
    """The vocabulary id of each image code, in code order, from the ``IMGIMG...Z`` names."""
    by_code = {}
    for name, vocab_id in vocabulary_map.items():
        match = IMAGE_NAME.match(name)
        if match:
            by_code[int("".join(str(ord(c) - ord("A")) for c in match.group(1)))] = int(vocab_id)
    if not by_code or sorted(by_code) != list(range(len(by_code))):
        raise FastARError(f"{source}: config.json's vocabulary_map does not name the image codes 0..N-1 "
                          "(IMGIMG...Z entries): this is not a Chameleon-family image model, or its config is damaged")
    return [by_code[k] for k in range(len(by_code))]


@dataclass
class ChameleonPrompts:
    """Prompts -> token ids: the model's own tokenizer and prompt template (the image prefix is added by
    the model)."""

    tokenizer: object  # tokenizers.Tokenizer
    template: str  # with {prompt}, and {w} {h} for Lumina-mGPT
    bos: int | None
    turn_end: str  # appended to the prompt text ("" for none)
    size: tuple[int, int]  # pixels (height, width)

    def encode(self, conditioning) -> list[list[int]]:
        if not isinstance(conditioning, PromptConditioning):
            raise FastARError("this is a text-to-image model: give it prompts (--prompt, or FastAR Text Conditioning)")
        h, w = self.size
        ids = []
        for prompt in conditioning.prompts:
            text = self.template.format(prompt=prompt, w=w, h=h) + self.turn_end
            tokens = encode_text(self.tokenizer, text)
            ids.append(([self.bos] if self.bos is not None else []) + tokens)
        return ids


def bos_token(folder: Path, tokenizer) -> int | None:
    settings = read_json(folder / "tokenizer_config.json") or {}
    bos = settings.get("bos_token", "<s>")
    if isinstance(bos, dict):
        bos = bos.get("content")
    return tokenizer.token_to_id(bos) if bos else None


def token_pixels(config: dict) -> int:
    """Pixels per image token side: the VQ model's downsampling (2 per level after the first); the level
    multipliers are ``channel_multiplier`` in transformers' configs, ``ch_mult`` in the 2024 ones."""
    vq = config.get("vq_config") or {}
    levels = vq.get("channel_multiplier") or vq.get("ch_mult")
    return 2 ** (len(levels) - 1) if levels else TOKEN


def is_lumina(config: dict, folder: Path) -> bool:
    return any("XLLMX" in a for a in (config.get("architectures") or [])) or "lumina" in folder.name.lower()


def lumina_shapes(size: int, max_ratio: float = 4.0) -> list[tuple[int, int]]:
    """(width, height) in pixels of the shapes Lumina-mGPT's release draws at ``size``: its
    ``generate_crop_size_list((size // 32) ** 2, 32)``, widest first."""
    budget = (size // PATCH) ** 2
    shapes, w, h = [], budget, 1
    while w > 0:
        if max(w, h) / min(w, h) <= max_ratio:
            shapes.append((w * PATCH, h * PATCH))
        if (h + 1) * w <= budget:
            h += 1
        else:
            w -= 1
    return shapes


def ratio_text(width: int, height: int) -> str:
    d = gcd(width, height)
    return f"{width // d}:{height // d}"


def lumina_shape(size: int, aspect_ratio: str | None) -> tuple[int, int]:
    """(height, width) in pixels at ``size`` and ``aspect_ratio`` ("W:H"): the release's shape of that ratio."""
    rw, rh = parse_ratio(aspect_ratio)
    shapes = lumina_shapes(size)
    match = next(((h, w) for w, h in shapes if w * rh == h * rw), None)
    if match is None:
        offered = ", ".join(ratio_text(w, h) for w, h in shapes)
        raise FastARError(f"aspect ratio {aspect_ratio}: Lumina-mGPT at {size} px draws the shapes of its release's "
                          f"size list, whose ratios (width:height) are {offered}")
    return match


def chameleon_size(lumina: bool, image_size: int | None, folder: Path, source: str,
                   aspect_ratio: str | None = None) -> int:
    if not lumina:
        if image_size not in (None, ANOLE_SIZE):
            raise FastARError(f"{source} is an Anole/Chameleon model, which draws {ANOLE_SIZE} px images only")
        width, height = parse_ratio(aspect_ratio)
        if width != height:
            raise FastARError(f"{source} is an Anole/Chameleon model, which draws square images: leave the aspect "
                              "ratio out (Emu3 and Lumina-mGPT models take one)")
        return ANOLE_SIZE
    if image_size is None:
        named = re.search(r"(512|768|1024)(?!\d)", folder.name)
        image_size = int(named.group(1)) if named else LUMINA_DEFAULT_SIZE
    if image_size % PATCH:
        raise FastARError(f"image size {image_size}: Lumina-mGPT sizes are multiples of {PATCH} px (the released "
                          f"models draw {', '.join(map(str, LUMINA_SIZES))}; pick the one the model was trained for)")
    return image_size


def load_chameleon(sd, *, info: CheckpointInfo, image_size: int | None = None, aspect_ratio: str | None = None,
                   device="cpu", dtype=torch.float32) -> ChameleonGPT:
    """A Lumina-mGPT or Anole model from an HF folder, with its tokenizer and layout; ``aspect_ratio`` ("W:H",
    Lumina-mGPT only) picks the release's non-square shape at ``image_size``."""
    if info.folder is None or not info.config:
        raise FastARError(f"{info.source}: a Chameleon-family model is read from its Hugging Face folder "
                          "(config.json, weights, tokenizer files): pick the folder, not a single file")
    weights = select(sd, {k: k for k in sd if not k.startswith("model.vqmodel.")})  # its VQ loads on its own
    with torch.device("meta"):
        model = build_chameleon(info.folder, info.config, info.source, image_size, qk_norm_rows(weights, info),
                                aspect_ratio)
    load_weights(model, weights, info.source, device, dtype)
    model.image_ids = torch.tensor(model.cfg.image_ids, dtype=torch.long, device=device)  # built on meta above
    model.keep_image_rows()
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


QK_NORM = "model.layers.0.self_attn.{}_norm.weight"


def qk_norm_rows(weights, info: CheckpointInfo) -> tuple[int, int] | None:
    """The rows of the stored QK-norm weights: None when there is one per head (transformers' layout), else
    (q rows, k rows), one per model-parallel shard (Lumina-mGPT's own classes); refused when they fit neither."""
    heads = info.config["num_attention_heads"]
    kv_heads = info.config.get("num_key_value_heads") or heads
    head_dim = info.config["hidden_size"] // heads
    rows = []
    for which, count in (("q", heads), ("k", kv_heads)):
        key = QK_NORM.format(which)
        if key not in weights:
            return None  # load_weights names what is missing
        shape = shape_of(weights, key)
        if len(shape) != 2 or shape[1] != head_dim or count % shape[0]:
            raise FastARError(
                f"{info.source}: {key} has shape {list(shape)}; a Chameleon-family QK norm is [{count}, {head_dim}] "
                f"(one row per head) or [shards, {head_dim}] with the {count} heads split evenly over the shards "
                "(Lumina-mGPT's model-parallel layout): these weights belong to another model size")
        rows.append(shape[0])
    return None if rows == [heads, kv_heads] else tuple(rows)


def build_chameleon(folder: Path, config: dict, source: str, image_size: int | None = None,
                    qk_rows: tuple[int, int] | None = None, aspect_ratio: str | None = None) -> ChameleonGPT:
    """The model a folder's config.json and tokenizer describe, with freshly initialised weights (QK norms of
    ``qk_rows`` rows, see ``qk_norm_rows``)."""
    tokenizer = load_tokenizer(folder, source)
    lumina = is_lumina(config, folder)
    size = chameleon_size(lumina, image_size or config.get("image_size"), folder, source, aspect_ratio)
    height, width = lumina_shape(size, aspect_ratio) if lumina else (size, size)
    heads = config["num_attention_heads"]
    bos = bos_token(folder, tokenizer)
    cfg = ChameleonConfig(
        hidden_size=config["hidden_size"], n_layer=config["num_hidden_layers"], n_head=heads,
        n_kv_head=config.get("num_key_value_heads") or heads, ffn_hidden=config["intermediate_size"],
        vocab_size=config["vocab_size"], image_ids=image_codes(config.get("vocabulary_map", {}), source),
        boi=token_id(tokenizer, BOI, source), eoi=token_id(tokenizer, EOI, source),
        grid=(height // token_pixels(config), width // token_pixels(config)),
        row_end=token_id(tokenizer, ROW_END, source) if lumina else None,
        size_ids=[token_id(tokenizer, size_token(side // PATCH), source) for side in (height, width)] if lumina else [],
        rope_theta=float((config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 10000.0))),
        rms_eps=config.get("rms_norm_eps", 1e-5), swin_norm=bool(config.get("swin_norm", False)),
        qk_norm_rows=qk_rows, bos=bos, uncond_bos=not lumina)
    # every official path ends the prompt with the turn separator, Anole's as well as Lumina-mGPT's
    prompts = ChameleonPrompts(tokenizer, LUMINA_TEMPLATE if lumina else "{prompt}", bos, TURN_END,
                               (height, width))
    return ChameleonGPT(cfg, prompts, "a Lumina-mGPT model" if lumina else "an Anole (Chameleon) model")


def load_vqgan(sd, *, info: CheckpointInfo, device="cpu", dtype=torch.float32) -> VQGAN:
    """Chameleon's VQGAN in eval mode (decoder, plus the encoder when the file has it)."""
    require_family(sd, info.source, IMAGE_DECODER)
    sd = {k: v for k, v in sd.items() if not k.startswith("loss.")}  # the training losses' networks
    with torch.device("meta"):
        model = VQGAN(VQGANConfig.from_state_dict(sd, info.source))
    load_weights(model, sd, info.source)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)
