"""Loading drafters for speculative decoding, checked against the target they will serve.

For token models, two kinds: an EAGLE head (LANTERN's format: config.json + ``fc``/``embed_tokens``
weights) that reads the target's hidden states, or a smaller model that shares the target's codes: a LlamaGen GPT
on the same VQ codes (any file ``load_ar_model`` reads), or for Emu3 a smaller Emu3 of the same tokenizer, loaded
at its target's grid (no EAGLE head serves Emu3). For a MAR target: a smaller MAR on the same latents (CSpD).
``"demo"`` names the bundled demo drafter of the target's kind.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ...errors import FastARError
from .. import LOADERS
from .small_ar import SmallARDrafter
from ..shared.checkpoint import AR_MODEL, FAMILY_KIND, FAMILY_WHAT, CheckpointInfo, detect_family, read_json, read_state_dict, sample_keys
from ..chameleon.model import ChameleonGPT
from ..emu3.model import Emu3GPT
from .eagle import EagleConfig, EagleDrafter, EagleHead, LayoutEagleDrafter
from ..shared.building import build_and_load, weight_shape
from ..shared.demo import DEMO_DRAFTER, DEMO_MAR_DRAFT, DEMO_TEXT_DRAFTER
from ..shared.joined import parted_state_dict
from ..shared.quantized import quantize_weights, stored_format_loading
from ..llamagen.model import LlamaGenGPT
from ..mar.loader import load_mar_draft

RETRAIN_HINT = "use a drafter trained for this target model (python -m fastar train-drafter makes one)"
KIND_NAMES = {"c2i": "class-to-image", "t2i": "text-to-image"}
SMALL_AR_FAMILIES = ("llamagen-gpt", "llamagen-gpt-hf")  # the checkpoints a small-model drafter can be
SAME_FAMILY = {Emu3GPT: "emu3"}  # targets whose codes are vocabulary entries, drafted by a smaller model of their family
PROBE = "a photo of a cat, 16:9; lowres"  # a drafter's tokenizer must encode prompts as the target's does


def load_drafter(path, target: LlamaGenGPT, *, device=None, dtype=None, weights: str = "auto"):
    """The drafter in a checkpoint file or folder, bound to ``target``; device and dtype default to the
    target's. ``weights``: its blocks in 8 bits (int8, fp8: quantized.py) or as the checkpoint has them."""
    drafter = read_drafter(path, target, device, dtype, weights)
    quantize_weights(drafter_weights(drafter), weights)  # an EAGLE head's (a model drafter's loaded so already)
    return drafter


def drafter_weights(drafter) -> torch.nn.Module:
    """The module holding a drafter's own weights (an EAGLE head borrows the rest from its target; a MAR
    draft is a model itself)."""
    if isinstance(drafter, torch.nn.Module):
        return drafter
    return drafter.head if isinstance(drafter, EagleDrafter) else drafter.model


def read_drafter(path, target, device, dtype, weights: str = "auto"):
    if target.kind == "masked-ar":
        return load_mar_draft(DEMO_MAR_DRAFT if path == "demo" else path, target, device=device, dtype=dtype,
                              weights=weights)
    path = (DEMO_TEXT_DRAFTER if isinstance(target, ChameleonGPT) else DEMO_DRAFTER) if path == "demo" else path
    sd, info = read_state_dict(path)
    device = target.device if device is None else device
    dtype = target.dtype if dtype is None else dtype
    family = detect_family(sd)
    if family == "eagle-drafter":
        return load_eagle(sd, info, Path(path), target, device, dtype)
    if family is None or FAMILY_KIND[family] != AR_MODEL:
        what = f"{FAMILY_WHAT[family]} ({family})" if family else f"no model FastAR knows (keys {sample_keys(sd)})"
        raise FastARError(f"{info.source} is {what}, not a drafter: pick an EAGLE drafter folder (config.json + "
                          "fc/embed_tokens weights) or a smaller LlamaGen GPT trained on the target's VQ codes "
                          "(FastAR's docs/models.md lists the drafters of each model)")
    if type(target) in SAME_FAMILY:
        return same_family_drafter(sd, info, family, target, device, dtype, weights)
    if not isinstance(target, LlamaGenGPT):
        raise FastARError(f"{info.source} is {FAMILY_WHAT[family]}: small-model drafters serve LlamaGen targets; "
                          f"for {target.what} pick its EAGLE drafter (LANTERN's release), or decode with sjd or gsd")
    if family not in SMALL_AR_FAMILIES:  # the kind first: a MAR, VAR or DD student cannot draft codes one by one
        raise FastARError(f"{info.source} is {FAMILY_WHAT[family]}, and the target is {target.what}: a drafter "
                          "for it is an EAGLE drafter folder or a smaller LlamaGen GPT trained on the same VQ codes")
    with stored_format_loading(info.metadata, weights, info.source, dtype):
        model = LOADERS[family](sd, info=info, device=device, dtype=dtype)
    check_ar_drafter(model, target, info.source)
    return SmallARDrafter(model)


def same_family_drafter(sd, info: CheckpointInfo, family: str, target, device, dtype, weights: str) -> SmallARDrafter:
    """A smaller model of the target's own family (Emu3), loaded at the target's grid, as a chain or tree drafter."""
    if family != SAME_FAMILY[type(target)]:
        raise FastARError(f"{info.source} is {FAMILY_WHAT[family]}, and the target is {target.what}: its drafter is a "
                          "smaller model of the same family with the same tokenizer (its vocabulary and visual tokens)")
    with stored_format_loading(info.metadata, weights, info.source, dtype):
        model = LOADERS[family](sd, info=info, device=device, dtype=dtype, grid=target.grid)
    check_vocabulary_drafter(model, target, info.source)
    return SmallARDrafter(model)


def check_vocabulary_drafter(model, target, source: str) -> None:
    """A drafter whose image codes are vocabulary entries writes the target's: the same code ids, layout tokens,
    negative prompt and prompt tokens."""
    d, t = model.cfg, target.cfg
    if d.image_ids != t.image_ids:
        raise FastARError(f"{source} names its {len(d.image_ids)} image codes by other vocabulary entries than the "
                          f"target's {len(t.image_ids)}: a drafter must share the target's tokenizer and vision "
                          "tokenizer; pick a smaller model of the same release")
    layout = (d.image_prefix, d.image_suffix, d.bos, model.layout.row_end, d.negative_ids)
    if layout != (t.image_prefix, t.image_suffix, t.bos, target.layout.row_end, t.negative_ids) or \
            model.prompts.text(PROBE) != target.prompts.text(PROBE):
        raise FastARError(f"{source} tokenizes prompts or lays out images with other tokens than the target: a "
                          "drafter must share the target's tokenizer files; pick a smaller model of the same release")


def load_eagle(sd, info: CheckpointInfo, path: Path, target, device, dtype) -> EagleDrafter:
    config = info.config if info.config is not None or path.is_dir() else read_json(path.parent / "config.json")
    cfg = EagleConfig.from_json(config, info.source)
    check_eagle(cfg, sd, target, info.source)
    kind = LayoutEagleDrafter if cfg.family == "chameleon" else EagleDrafter
    return kind(build_and_load(EagleHead, cfg, sd, info.source, device, dtype), target)


def check_eagle(cfg: EagleConfig, sd, target, source: str) -> None:
    serves = {"llama": (LlamaGenGPT, "LlamaGen models"), "chameleon": (ChameleonGPT, "Chameleon-family models (Anole)")}
    model_class, models = serves[cfg.family]
    if isinstance(target, Emu3GPT):
        raise FastARError(f"{source} is an EAGLE drafter for {models}; no EAGLE drafter serves {target.what}: draft "
                          "with a smaller Emu3 model of the same tokenizer (--drafter, for spec and its trees), or "
                          "decode without a drafter (sjd, sjd-pac, zipar-sjd)")
    if not isinstance(target, model_class):
        raise FastARError(f"{source} is an EAGLE drafter for {models}; the target is {target.what}: pick a "
                          "drafter made for the target's family")
    vocab, width = weight_shape(sd, "embed_tokens.weight", source)
    if isinstance(target, ChameleonGPT):
        check_layout_eagle(target, cfg, vocab, source)
        dim = target.cfg.hidden_size
    else:
        dim = target.cfg.dim
        if vocab != target.cfg.vocab_size:
            raise FastARError(f"{source} drafts over {vocab} codes but the target model has {target.cfg.vocab_size} "
                              f"(a different VQ tokenizer): {RETRAIN_HINT}")
        check_kind(cfg.model_type, target.cfg.model_type, source)
    reads = weight_shape(sd, "fc.weight", source)[1]
    if reads != 2 * dim or width != dim:
        raise FastARError(f"{source} reads hidden states of width {reads // 2} (embedding width {width}) but the "
                          f"target model is {dim} wide: it belongs to another model size; {RETRAIN_HINT}")
    if cfg.grid is not None and tuple(cfg.grid) != tuple(target.grid):
        raise FastARError(f"{source} was trained for a {grid_text(cfg.grid)} token grid but the target runs "
                          f"{grid_text(target.grid)}: load the target at the drafter's resolution, or {RETRAIN_HINT}")


def check_layout_eagle(target: ChameleonGPT, cfg: EagleConfig, vocab: int, source: str) -> None:
    if vocab != target.cfg.vocab_size:
        raise FastARError(f"{source} embeds a vocabulary of {vocab} tokens but {target.what} has "
                          f"{target.cfg.vocab_size}: pick the drafter released for this model")
    if (target.cfg.row_end is not None) != cfg.skips_row_ends:
        made_for = "a layout with row-end tokens (Lumina-mGPT)" if cfg.skips_row_ends else "a layout without row-end tokens"
        raise FastARError(f"{source} was trained for {made_for}, and {target.what} "
                          f"{'has' if target.cfg.row_end is not None else 'has no'} row-end tokens: {RETRAIN_HINT}")


def check_ar_drafter(model: LlamaGenGPT, target, source: str) -> None:
    d, t = model.cfg, target.cfg
    if d.vocab_size != t.vocab_size:
        raise FastARError(f"{source} draws {d.vocab_size} codes but the target model draws {t.vocab_size}: a drafter "
                          "must share the target's VQ tokenizer; pick a small model trained on the same tokenizer")
    check_kind(d.model_type, t.model_type, source)
    if tuple(d.grid) != tuple(t.grid):
        raise FastARError(f"{source} generates a {grid_text(d.grid)} token grid but the target generates "
                          f"{grid_text(t.grid)}: use a drafter for the same image size")
    if d.model_type == "c2i" and d.num_classes != t.num_classes:
        raise FastARError(f"{source} knows {d.num_classes} classes but the target model {t.num_classes}: "
                          "a drafter must be trained on the target's classes")
    if d.model_type == "t2i" and (d.caption_dim, d.cls_token_num) != (t.caption_dim, t.cls_token_num):
        raise FastARError(f"{source} reads {d.cls_token_num} caption features of width {d.caption_dim} but the "
                          f"target reads {t.cls_token_num} of width {t.caption_dim}: a drafter must take the "
                          "target's text encoder features")


def check_kind(drafter_type: str | None, target_type: str, source: str) -> None:
    if drafter_type is not None and drafter_type != target_type:
        raise FastARError(f"{source} is a drafter for a {KIND_NAMES[drafter_type]} model but the target model is "
                          f"{KIND_NAMES[target_type]}: pick a drafter for the target's kind")


def grid_text(grid) -> str:
    return f"{grid[0]}x{grid[1]}"


def save_eagle_drafter(drafter: EagleDrafter, folder) -> None:
    """The drafter as a LANTERN-format folder: config.json + model.safetensors in fp16."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to("cpu", torch.float16).contiguous() for k, v in parted_state_dict(drafter.head).items()}
    save_file(sd, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(drafter.head.cfg.to_json(), indent=2) + "\n")
