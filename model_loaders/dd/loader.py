"""Loading Distilled Decoding students: the released LlamaGen-DD files (``llamagen-B.pt``, ``llamagen-L.pt``;
weights under ``["ema"]``, which wins over ``"model"``) and the ones FastAR's distill-dd writes.

The config comes from FastAR's ``fastar_config`` metadata when present; otherwise from the shapes, with the
heads from the training args or a config.json (or the official size table), the image size from the same
places (the released students are 256 px, the default here without a warning), and the split point from the
official table (B: 80, L: 130) or the config's ``split_t`` (another size without one: the DD run must give it).
"""
from __future__ import annotations

import re

import torch

from ..shared.checkpoint import CheckpointInfo
from .student import DEFAULT_T2, OFFICIAL_SPLITS, DDStudent, DDStudentConfig
from ..llamagen.loader import DOWNSAMPLE, grid_for, grid_of, head_count, saved_config
from ..shared.building import build_and_load, checkpoint_of, first_setting, weight_shape

DD_IMAGE_SIZE = 256  # every released LlamaGen-DD student


def load_dd_student(path_or_state_dict, *, image_size: int | None = None, device="cpu", dtype=torch.float32,
                    info: CheckpointInfo | None = None) -> DDStudent:
    """A DD student in eval mode without gradients."""
    sd, info = checkpoint_of(path_or_state_dict, info)
    return build_and_load(DDStudent, dd_config(sd, info, image_size), sd, info.source, device, dtype)


def dd_config(sd, info: CheckpointInfo, image_size: int | None = None) -> DDStudentConfig:
    saved = saved_config(DDStudentConfig, info, image_size)
    if saved is not None:
        return saved
    settings, source = info.settings(), info.source
    vocab_size, dim = weight_shape(sd, "output.weight", source)
    channels = weight_shape(sd, "tok_embeddings.weight", source)[1]
    n_layer = 1 + max(int(m.group(1)) for k in sd if (m := re.match(r"layers\.(\d+)\.", k)))
    n_head = head_count(n_layer, dim, settings, source)
    qkv_rows = weight_shape(sd, "layers.0.attention.wqkv.weight", source)[0]
    said_size = image_size or any(settings.get(k) for k in ("image_size", "block_size"))
    grid = grid_of(info, image_size, DOWNSAMPLE) if said_size else grid_for(DD_IMAGE_SIZE, DOWNSAMPLE, source)
    return DDStudentConfig(
        dim=dim, n_layer=n_layer, n_head=n_head, vocab_size=vocab_size, grid=grid, channels=channels,
        n_kv_head=(qkv_rows // (dim // n_head) - n_head) // 2,
        ffn_hidden=weight_shape(sd, "layers.0.feed_forward.w1.weight", source)[0],
        num_classes=weight_shape(sd, "cls_embedding.embedding_table.weight", source)[0] - 1,
        norm_eps=float(first_setting(settings, ("norm_eps",), 1e-5)),
        rope_base=float(first_setting(settings, ("rope_base",), 10000.0)),
        **split_of(settings, (n_layer, dim), source),
        t2=int(first_setting(settings, ("t2",), DEFAULT_T2)),
    )


def split_of(settings: dict, shape: tuple[int, int], source: str) -> dict:
    """The student's split point (config fields): its config's, the released size's, or unknown (the DD run must
    give it: a guessed split would draw a broken image without a word)."""
    said = first_setting(settings, ("split_t", "split"), None)
    if said is not None:
        return {"split": int(said)}
    if shape in OFFICIAL_SPLITS:
        return {"split": OFFICIAL_SPLITS[shape]}
    return {"split": None, "unknown_split": f"{source} is a {shape[0]}-layer, {shape[1]}-wide LlamaGen-DD student, "
                                           "none of the released sizes, and nothing beside it says its split point"}

