"""FLAN-T5 caption features for the text-to-image models that read them (LlamaGen T2I, Infinity), from a local HF
folder (never the network).

``transformers`` is an optional dependency, imported only when an encoder is loaded. Each release's layout:
LlamaGen's 120 tokens of the normalised prompt, padding moved to the front (left-padded); Infinity's prompt verbatim
(up to 512 tokens, ``</s>`` kept), its real tokens first (a model says so with ``caption_padding = "right"``). The
padding is zeroed and the mask is bool.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ...errors import FastARError
from ..shared.protocol import CaptionConditioning

CAPTION_TOKENS = 120
TOKENIZER_FILES = ("tokenizer.json", "spiece.model")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
FOLDER_HINT = ("download the whole google/flan-t5-xl folder (config.json, tokenizer files, weights) and pick it; "
               "FastAR's docs/models.md says where it goes")


@dataclass
class T5TextEncoder:
    model: torch.nn.Module  # transformers.T5EncoderModel
    tokenizer: object  # a transformers tokenizer

    @property
    def device(self) -> torch.device:
        return self.model.device


def load_t5_encoder(folder, *, device="cpu", dtype=torch.float32) -> T5TextEncoder:
    """The encoder half of a T5 model folder, in eval mode. Use fp32 or bf16: T5 overflows in fp16."""
    folder = Path(folder)
    check_t5_folder(folder)
    transformers = import_transformers()
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
        model = transformers.T5EncoderModel.from_pretrained(folder, local_files_only=True, dtype=dtype)
    except (OSError, ValueError) as e:
        raise FastARError(f"the T5 folder {folder.name} could not be loaded ({e}): {FOLDER_HINT}") from e
    tokenizer.padding_side = "right"  # as trained; encode_captions moves the padding to the front
    return T5TextEncoder(model.to(device=device, dtype=dtype).eval().requires_grad_(False), tokenizer)


def check_t5_folder(folder: Path) -> None:
    if not folder.is_dir():
        raise FastARError(f"no T5 text encoder folder at {folder}: {FOLDER_HINT}")
    missing = []
    if not (folder / "config.json").is_file():
        missing.append("config.json")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        missing.append(f"a tokenizer ({' or '.join(TOKENIZER_FILES)})")
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        missing.append(f"weights ({', '.join(WEIGHT_FILES)})")
    if missing:
        raise FastARError(f"the T5 folder {folder} is incomplete, it lacks {'; '.join(missing)}: {FOLDER_HINT}")


def import_transformers():
    try:
        import transformers
    except ImportError as e:
        raise FastARError("text-to-image models need the optional `transformers` package for their T5 text "
                          "encoder: pip install 'transformers>=4.40' sentencepiece") from e
    return transformers


def normalise_prompt(prompt: str) -> str:
    """The part of the official caption cleaning that matters for typed prompts: lower case, single spaces."""
    return " ".join(prompt.lower().split())


def captions_for(model, encoder: T5TextEncoder, prompts: list[str]) -> CaptionConditioning:
    """The caption features ``model`` was trained on, in its release's layout."""
    if getattr(model, "caption_padding", "left") == "right":
        return encode_verbatim(encoder, prompts, model.caption_tokens)
    return encode_captions(encoder, prompts)


@torch.no_grad()
def encode_verbatim(encoder: T5TextEncoder, prompts: list[str], max_len: int) -> CaptionConditioning:
    """Features ``[B, T, C]`` of each prompt as typed, real tokens first, T the longest prompt's tokens: the padding
    the release adds up to ``max_len`` is masked out of every use, so it is not computed."""
    batch = encoder.tokenizer(prompts, max_length=max_len, padding="longest", truncation=True, return_tensors="pt")
    ids, mask = batch["input_ids"].to(encoder.device), batch["attention_mask"].to(encoder.device).bool()
    features = encoder.model(input_ids=ids, attention_mask=mask.long()).last_hidden_state
    return CaptionConditioning(embeddings=features * mask[..., None], mask=mask)


@torch.no_grad()
def encode_captions(encoder: T5TextEncoder, prompts: list[str], max_len: int = CAPTION_TOKENS) -> CaptionConditioning:
    """Caption features ``[B, max_len, C]`` left-padded with a bool mask, as LlamaGen's T2I was trained."""
    batch = encoder.tokenizer([normalise_prompt(p) for p in prompts], max_length=max_len, padding="max_length",
                              truncation=True, return_tensors="pt")
    ids, mask = batch["input_ids"].to(encoder.device), batch["attention_mask"].to(encoder.device)
    features = encoder.model(input_ids=ids, attention_mask=mask).last_hidden_state
    return left_padded(features, mask.bool())


def left_padded(features: torch.Tensor, mask: torch.Tensor) -> CaptionConditioning:
    """Rotate each right-padded row so its valid tokens come last (the official ``cat([f[n:], f[:n]])``
    with the mask flipped), and zero the padding."""
    length = features.shape[1]
    valid = mask.sum(dim=1, keepdim=True)
    positions = torch.arange(length, device=features.device)
    source = (positions + valid) % length
    rotated = features.gather(1, source[..., None].expand_as(features))
    left_mask = positions >= length - valid
    return CaptionConditioning(embeddings=rotated * left_mask[..., None], mask=left_mask)
