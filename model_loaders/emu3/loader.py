"""Loading Emu3 (BAAI's Emu3-Gen) from its folder, in either release layout, with its tokenizer, image layout and
negative prompt.

transformers' layout (``BAAI/Emu3-Gen-hf``; ``Emu3ForConditionalGeneration.save_pretrained``): config.json with
``text_config`` and ``vq_config`` and the ``vocabulary_map`` (token name -> id), ``tokenizer.json``, the weights
``text_model.model.*``, ``text_model.lm_head.weight`` and ``vqmodel.*`` as save_pretrained writes them (transformers
5 renames them to ``model.text_model.*``, ``lm_head.weight``, ``model.vqmodel.*`` in memory; both are read). The
text model is LLaMA's: q, k, v, o projections without biases (GQA), SwiGLU, RMSNorm, 1-D RoPE (base 1e6).

BAAI's layout (``BAAI/Emu3-Gen``, read without running its code): config.json at the top level (``model_type``
``Emu3``, ``image_area``, the special tokens' ids), the weights ``model.*`` and ``lm_head.weight`` (LLaMA's names),
and its tiktoken tokenizer: ``emu3.tiktoken`` (Qwen's 151,643 ranked byte sequences, split by Qwen's pattern, after
NFC) and ``emu3_vision_tokens.txt`` (``<|image token|>``, ``<|image start|>``, ``<|image end|>``, the visual tokens),
special tokens numbered on from the last rank: ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, ``<|extra_0|>`` ..
``<|extra_204|>``, then the file's (BAAI's ``Emu3Tokenizer`` starts them at 151,643, which its own check makes the
number of ranks). FastAR makes the equivalent ``tokenizers`` BPE (shared/tokenizing.py); the ids config.json names
must be the tokenizer's.

- Image code k is the vocabulary entry named ``<|visual token {k:06d}|>`` (read from the map, never assumed to be
  an offset).
- Prompt: bos ``<|extra_203|>``, the prompt text, ``<|image start|>``, the grid as text ``"{h}*{w}"``, ``<|image
  token|>``; the image's rows each end with ``<|extra_200|>``, then ``<|extra_201|>``, ``<|image end|>``, eos
  ``<|extra_204|>`` (the processors of both releases and BAAI's prefix-constrained function).
- Grid: an image area and a width:height ratio, 8 pixels per token: ``round(h * sqrt(area / (w * h)) / 8)`` rows and
  as many columns for w (both processors' ``calculate_generate_size``); the area is ``image_size``² (default 720²,
  the release's ``image_area``).
- CFG guides against a negative prompt with the same image header; without one given, BAAI's published negative
  prompt (``image_generation.py``). Its quality suffix for the prompt is the user's to add.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ...errors import FastARError
from ..shared.checkpoint import CheckpointInfo, load_weights, read_json, renamed, shape_of
from ..shared.building import parse_ratio
from ..shared.llm_decoder import DecoderConfig
from ..shared.protocol import PromptConditioning
from ..shared.tokenizing import encode_text, load_tokenizer, read_tiktoken_ranks, tiktoken_tokenizer, token_id
from .model import Emu3Config, Emu3GPT

# BAAI's image_generation.py
NEGATIVE_PROMPT = ("lowres, bad anatomy, bad hands, text, error, missing fingers, extra digit, fewer digits, cropped, "
                   "worst quality, low quality, normal quality, jpeg artifacts, signature, watermark, username, blurry.")
QUALITY_SUFFIX = " masterpiece, film grained, best quality."  # BAAI appends it to every prompt; FastAR does not

# token names (the defaults of BAAI's Emu3Tokenizer; transformers' tokenizer_config.json names the same)
BOS, EOS = "<|extra_203|>", "<|extra_204|>"
BOI, IMAGE_TOKEN, EOI = "<|image start|>", "<|image token|>", "<|image end|>"
ROW_END, EOF = "<|extra_200|>", "<|extra_201|>"
VISUAL = re.compile(r"^<\|visual token (\d{6})\|>$")

# BAAI's tokenizer files (tokenization_emu3.py)
TIKTOKEN_FILE, VISION_TOKENS_FILE = "emu3.tiktoken", "emu3_vision_tokens.txt"
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
         r"\s+(?!\S)|\s+")
BAAI_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", *(f"<|extra_{i}|>" for i in range(205)))
CONFIG_IDS = (("bos_token_id", BOS), ("eos_token_id", EOS), ("boi_token_id", BOI), ("img_token_id", IMAGE_TOKEN),
              ("eoi_token_id", EOI), ("eol_token_id", ROW_END), ("eof_token_id", EOF))  # BAAI's config.json

DEFAULT_AREA = 720 * 720  # the release's image_area (BAAI's config.json; both processors' default 518400)
TOKEN = 8  # pixels per image token side (transformers' processor: downsample_ratio 8; the VisionTokenizer's factor)
MAX_POSITIONS = 9216  # the release's max_position_embeddings

TEXT_NAMES = (  # transformers' names, as saved and as in memory -> the internal ones; None: not the text model
    (re.compile(r"^text_model\.model\."), "model."),
    (re.compile(r"^text_model\.lm_head\."), "lm_head."),
    (re.compile(r"^model\.text_model\."), "model."),
    (re.compile(r"^(model\.)?vqmodel\."), None),
)


def text_weights(sd):
    """The text model's weights under the internal names (``model.*``, ``lm_head.weight``); shards are not read."""
    return renamed(sd, TEXT_NAMES)


def image_codes(vocabulary: dict, source: str) -> list[int]:
    """The vocabulary id of each image code, in code order, from the ``<|visual token NNNNNN|>`` names."""
    by_code = {int(m.group(1)): int(i) for name, i in vocabulary.items() if (m := VISUAL.match(name))}
    if not by_code or sorted(by_code) != list(range(len(by_code))):
        raise FastARError(f"{source}: its vocabulary does not name the image codes 0..N-1 (<|visual token NNNNNN|> "
                          "entries of config.json's vocabulary_map): this is not an Emu3 image-generation model, or "
                          "its config is damaged (re-download config.json)")
    return [by_code[k] for k in range(len(by_code))]


def emu3_grid(area: int, ratio: str | None) -> tuple[int, int]:
    """(rows, columns) of image tokens for an image ``area`` in pixels at ``ratio`` ("W:H"), as both processors'
    ``calculate_generate_size`` computes them (Python's round: halves to even)."""
    width, height = parse_ratio(ratio)
    scale = (area / (width * height)) ** 0.5
    return int(round(height * scale / TOKEN)), int(round(width * scale / TOKEN))


def check_grid(grid: tuple[int, int], size: int, ratio: str | None, positions: int = MAX_POSITIONS) -> None:
    rows, columns = grid
    if rows < 1 or columns < 1:
        raise FastARError(f"image size {size} at {ratio or '1:1'} gives a grid of {rows} x {columns} tokens: Emu3 draws "
                          f"{TOKEN} px per token, pick a larger size (the release's is 720)")
    if rows * (columns + 1) + 3 > positions:
        raise FastARError(f"image size {size} at {ratio or '1:1'} gives {rows} x {columns} tokens, more than the "
                          f"model's {positions} positions hold with their row ends: pick a smaller size (the "
                          "release's is 720)")


def named_token(folder, name: str, default: str) -> str:
    """A special token's name as tokenizer_config.json gives it (``bos_token``, ``boi_token``, ...), else the
    release's."""
    settings = read_json(folder / "tokenizer_config.json") or {}
    extra = settings.get("extra_special_tokens")
    value = settings.get(name) or (extra.get(name) if isinstance(extra, dict) else None)
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) and value else default


@dataclass
class Emu3Prompts:
    """Prompts (and negative prompts) -> token ids: bos, then the text through the model's own tokenizer (the image
    header is added by the model)."""

    tokenizer: object  # tokenizers.Tokenizer
    bos: int

    def encode(self, conditioning) -> list[list[int]]:
        if not isinstance(conditioning, PromptConditioning):
            raise FastARError("this is a text-to-image model: give it prompts (--prompt, or FastAR Text Conditioning)")
        return [self.text(p) for p in conditioning.prompts]

    def encode_negative(self, conditioning) -> list[list[int]] | None:
        """Each row's negative prompt (one given for all rows, or one per row); None: the model's default."""
        negatives = getattr(conditioning, "negative_prompts", None)
        if negatives is None:
            return None
        rows = conditioning.batch
        if len(negatives) == 1:
            negatives = list(negatives) * rows
        if len(negatives) != rows:
            raise FastARError(f"{len(negatives)} negative prompts for {rows} prompts: give one for all of them, or "
                              "one per prompt")
        return [self.text(n) for n in negatives]

    def text(self, text: str) -> list[int]:
        return [self.bos, *encode_text(self.tokenizer, text)]


def emu3_tokenizer(folder, source: str):
    """The folder's tokenizer: ``tokenizer.json`` (transformers' layout), else BAAI's tiktoken files."""
    if (folder / "tokenizer.json").is_file() or not (folder / TIKTOKEN_FILE).is_file():
        return load_tokenizer(folder, source)
    if not (folder / VISION_TOKENS_FILE).is_file():
        raise FastARError(f"{source} has {TIKTOKEN_FILE} without {VISION_TOKENS_FILE}: copy every tokenizer file of "
                          "the release (emu3.tiktoken, emu3_vision_tokens.txt, tokenizer_config.json) into the folder")
    ranks = read_tiktoken_ranks(folder / TIKTOKEN_FILE, source)
    lines = (folder / VISION_TOKENS_FILE).read_text(encoding="utf-8").splitlines()
    names = [*BAAI_SPECIALS, *(line.strip() for line in lines if line.strip())]
    return tiktoken_tokenizer(ranks, SPLIT, {name: len(ranks) + i for i, name in enumerate(names)})


def is_emu3(config: dict) -> bool:
    return (config.get("model_type") or "").lower() in ("emu3", "emu3_text_model") or any(
        "Emu3" in a for a in config.get("architectures") or [])


def check_config_ids(config: dict, token: dict, source: str) -> None:
    """The special tokens' ids config.json names (BAAI's layout) must be the tokenizer's."""
    wrong = [f"{key} {config[key]} (the tokenizer's {name} is {token[name]})" for key, name in CONFIG_IDS
             if isinstance(config.get(key), int) and config[key] != token[name]]
    if wrong:
        raise FastARError(f"{source}: config.json and the tokenizer files disagree: {', '.join(wrong)}; they belong "
                          "to different models (re-download the release's files)")


def text_settings(config: dict) -> dict:
    """The text model's config: ``text_config`` (transformers) or the top level (BAAI's)."""
    return config.get("text_config") or config


def rope_theta(settings: dict) -> float:
    return float((settings.get("rope_parameters") or {}).get("rope_theta", settings.get("rope_theta", 1e6)))


def load_emu3(sd, *, info: CheckpointInfo, image_size: int | None = None, aspect_ratio: str | None = None,
              device="cpu", dtype=torch.float32, grid: tuple[int, int] | None = None) -> Emu3GPT:
    """An Emu3 model from its folder, with its tokenizer; the grid from ``image_size`` (the side of a square of the
    same area, default 720) and ``aspect_ratio`` ("W:H", default 1:1), or ``grid`` (rows, columns) itself (a drafter
    takes its target's)."""
    folder, config = info.folder, info.config or {}
    if folder is None or not config:
        raise FastARError(f"{info.source}: an Emu3 model is read from its folder (config.json, weights, tokenizer "
                          "files): pick the folder, not a single file (FastAR's docs/models.md)")
    if not is_emu3(config):
        raise FastARError(f"{info.source} has a LLaMA-style model's weights, but its config.json does not say Emu3 "
                          f"(model_type {config.get('model_type')!r}): FastAR loads no plain LLaMA models; pick an "
                          "Emu3 folder (or copy the release's config.json into it)")
    weights = text_weights(sd)
    with torch.device("meta"):
        model = build_emu3(folder, config, weights, info.source, image_size, aspect_ratio, grid)
    load_weights(model, weights, info.source, device, dtype)
    model.image_ids = torch.tensor(model.cfg.image_ids, dtype=torch.long, device=device)  # built on meta above
    model.keep_image_rows()
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def build_emu3(folder, config: dict, weights, source: str, image_size: int | None = None,
               aspect_ratio: str | None = None, grid: tuple[int, int] | None = None) -> Emu3GPT:
    """The model a folder describes (its config.json, tokenizer and the shapes of ``weights``), freshly initialised."""
    tokenizer = emu3_tokenizer(folder, source)
    settings = text_settings(config)
    heads = settings.get("num_attention_heads")
    if heads is None:
        raise FastARError(f"{source}: config.json does not give the text model's num_attention_heads: re-download "
                          "the model's config.json")
    for key in ("model.embed_tokens.weight", "model.layers.0.self_attn.k_proj.weight", "model.layers.0.mlp.gate_proj.weight"):
        if key not in weights:
            raise FastARError(f"{source} has no {key.replace('model.', 'text_model.model.', 1)} weight: the download "
                              "is incomplete (every shard of the model is needed), or this is not an Emu3 model")
    vocab, hidden = shape_of(weights, "model.embed_tokens.weight")
    area = image_size ** 2 if image_size else int(config.get("image_area") or DEFAULT_AREA)
    grid = tuple(grid) if grid is not None else emu3_grid(area, aspect_ratio)
    check_grid(grid, image_size or round(area ** 0.5), aspect_ratio,
               settings.get("max_position_embeddings") or MAX_POSITIONS)
    token = {name: token_id(tokenizer, named_token(folder, key, name), source) for key, name in (
        ("bos_token", BOS), ("eos_token", EOS), ("boi_token", BOI), ("image_wrapper_token", IMAGE_TOKEN),
        ("eoi_token", EOI), ("eof_token", EOF), ("eol_token", ROW_END))}
    check_config_ids(config, token, source)
    vocabulary = config.get("vocabulary_map") or tokenizer.get_vocab(with_added_tokens=True)
    image_ids = image_codes(vocabulary, source)
    if max(image_ids + list(token.values())) >= vocab:
        raise FastARError(f"{source}: its tokenizer or vocabulary_map names ids beyond the {vocab} rows of its "
                          "embeddings: the config or tokenizer files belong to another model (re-download them)")
    decoder = DecoderConfig(
        hidden_size=hidden, n_layer=len({k.split(".")[2] for k in weights if k.startswith("model.layers.")}),
        n_head=heads, n_kv_head=shape_of(weights, "model.layers.0.self_attn.k_proj.weight")[0] // (hidden // heads),
        ffn_hidden=shape_of(weights, "model.layers.0.mlp.gate_proj.weight")[0], vocab_size=vocab,
        rope_theta=rope_theta(settings), rms_eps=settings.get("rms_norm_eps", 1e-5))
    cfg = Emu3Config(
        decoder=decoder, image_ids=image_ids, grid=grid, bos=token[BOS], boi=token[BOI],
        image_token=token[IMAGE_TOKEN], row_end=token[ROW_END], eof=token[EOF], eoi=token[EOI], eos=token[EOS],
        size_ids=encode_text(tokenizer, f"{grid[0]}*{grid[1]}"), negative_ids=encode_text(tokenizer, NEGATIVE_PROMPT))
    return Emu3GPT(cfg, Emu3Prompts(tokenizer, cfg.bos))
