"""The oldest PyTorch FastAR runs on, checked before a model loads: attention asks ``scaled_dot_product_attention``
for grouped-query heads (``enable_gqa``, PyTorch 2.5), and an older PyTorch would fail deep inside the first
forward with an unhelpful TypeError."""
from __future__ import annotations

import re

import torch

from .errors import FastARError

MINIMUM = (2, 5)


def version_tuple(text: str) -> tuple[int, int]:
    numbers = re.match(r"(\d+)\.(\d+)", text)
    return (int(numbers[1]), int(numbers[2])) if numbers else (0, 0)


def check_torch_version(version: str | None = None) -> None:
    version = version or torch.__version__
    if version_tuple(version) < MINIMUM:
        raise FastARError(f"FastAR needs PyTorch {MINIMUM[0]}.{MINIMUM[1]} or newer; this is {version}. Update "
                          "PyTorch (for ComfyUI: its update script, or pip install -U torch with the index URL of your "
                          "CUDA version from pytorch.org)")
