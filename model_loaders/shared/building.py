"""From a checkpoint to a model, the steps every family's loader shares: the state dict of a path or of a given
dict, the config FastAR saved in the metadata, a weight's shape (or a clear message when it is missing), the first
of several setting names a config may use, the official size tables, an aspect ratio as users give it (for the
releases that draw other shapes than squares), and the model built on the meta device and loaded in eval mode."""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ...errors import FastARError
from .checkpoint import (WEIGHT_SUFFIXES, CheckpointInfo, clean_state_dict, load_weights, read_state_dict,
                         unwrap_checkpoint)


def checkpoint_of(path_or_state_dict, info: CheckpointInfo | None):
    if not isinstance(path_or_state_dict, Mapping):
        return read_state_dict(path_or_state_dict)
    tensors, args = unwrap_checkpoint(path_or_state_dict)
    info = info or CheckpointInfo(source="the given state dict", args=args)
    return clean_state_dict(tensors, info.source), info


def build_and_load(model_class, cfg, sd, source: str, device, dtype) -> nn.Module:
    try:
        with torch.device("meta"):
            model = model_class(cfg)
    except ValueError as e:
        raise FastARError(f"{source}: {e}; the config saved with the weights does not fit them") from e
    load_weights(model, sd, source)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def config_from_metadata(config_class, saved: dict, source: str):
    try:
        return config_class(**saved)
    except TypeError as e:
        raise FastARError(f"{source}: its fastar_config metadata does not fit this FastAR version ({e}): "
                          "update FastAR, or re-create the file with this version") from e


def weight_shape(sd, key: str, source: str) -> torch.Size:
    if key not in sd:
        raise FastARError(f"{source} has no {key} weight: the file is incomplete, re-download it")
    return sd[key].shape


def first_setting(settings: dict, names: tuple[str, ...], default):
    return next((settings[n] for n in names if settings.get(n) is not None), default)


def official_heads(table: dict, name, shape: tuple) -> int | None:
    """The heads of an official size: the one the training args name, else any whose other entries are
    ``shape``. ``table`` maps a name to (shape..., heads)."""
    candidates = [table[name]] if name in table else table.values()
    return next((entry[-1] for entry in candidates if tuple(entry[:-1]) == shape), None)


def where_config_goes(source: str) -> str:
    """Advice on where FastAR reads a config for ``source``: NAME.json beside NAME.pt, or a folder's config.json."""
    stem, dot, suffix = source.rpartition(".")
    if dot and f".{suffix.lower()}" in WEIGHT_SUFFIXES:
        return f"Write {stem}.json next to {source} with"
    return "Write the folder's config.json with"


def parse_ratio(ratio: str | None) -> tuple[int, int]:
    """``"W:H"`` (width first, as the releases' processors take it) -> (width, height); None is 1:1."""
    if ratio is None:
        return 1, 1
    try:
        width, height = (int(part) for part in str(ratio).split(":"))
    except ValueError:
        width = height = 0
    if width <= 0 or height <= 0:
        raise FastARError(f"aspect ratio {ratio!r}: give it as WIDTH:HEIGHT in whole numbers, e.g. 16:9 or 1:1")
    return width, height
