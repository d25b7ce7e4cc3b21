"""LlamaGen's own sampling loop (``autoregressive/models/generate.py`` of FoundationVision/LlamaGen) on the weights
of the model being profiled: the loop its users run today, from a checkout the user gives (``--llamagen-code``);
FastAR neither ships nor fetches it.

Its ``generate()`` sets up a static cache per call, runs one forward per token with cond and uncond rows in one
batch, and draws with ``torch.multinomial`` from the global generator. ``compiled`` wraps the model as the
release's sample script does with ``--compile``: ``torch.compile(mode="reduce-overhead", fullgraph=True)``.
"""
from __future__ import annotations

import importlib
import sys
import warnings
from pathlib import Path

import torch

from ...errors import FastARError
from ...model_loaders.llamagen.model import LlamaGenGPT
from ...model_loaders.shared.joined import parted_state_dict
from ...samplers.processing import SamplingSettings
from .common import ImageLoop, seed_global_generator

MODULES = ("autoregressive/models/gpt.py", "autoregressive/models/generate.py")


def official_modules(checkout) -> tuple:
    """The release's ``gpt`` and ``generate`` modules, imported from ``checkout``."""
    root = Path(checkout).expanduser().resolve()
    missing = [m for m in MODULES if not (root / m).is_file()]
    if missing:
        raise FastARError(f"--llamagen-code {checkout}: no {', '.join(missing)} there; give a checkout of "
                          "FoundationVision/LlamaGen (git clone https://github.com/FoundationVision/LlamaGen)")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))  # its modules import each other from the checkout's root
    return (importlib.import_module("autoregressive.models.gpt"),
            importlib.import_module("autoregressive.models.generate"))


def official_gpt(model: LlamaGenGPT, checkout):
    """The release's ``Transformer`` holding ``model``'s weights (shared, not copied), and its generate module."""
    gpt, generate = official_modules(checkout)
    cfg = model.cfg
    rows, cols = model.grid
    if rows != cols:
        raise FastARError(f"LlamaGen's generate() draws square grids only; this model's is {rows} x {cols}")
    args = gpt.ModelArgs(dim=cfg.dim, n_layer=cfg.n_layer, n_head=cfg.n_head, n_kv_head=cfg.n_kv_head,
                         rope_base=cfg.rope_base, norm_eps=cfg.norm_eps, num_classes=cfg.num_classes,
                         model_type=cfg.model_type, vocab_size=cfg.vocab_size, cls_token_num=cfg.cls_token_num,
                         block_size=rows * cols, token_dropout_p=0.0, resid_dropout_p=0.0, ffn_dropout_p=0.0)
    reference = gpt.Transformer(args)  # in host memory (its init reads tensors: no meta build), then given the
    # profiled model's tensors in place of its own
    reference.load_state_dict(parted_state_dict(model), strict=True, assign=True)
    return reference.eval(), generate


def official_loops(model: LlamaGenGPT, checkout, *, compiled: bool = False) -> dict[str, ImageLoop]:
    """LlamaGen's ``generate()`` on ``model``'s weights, by name: eagerly and, with ``compiled``, on the same
    reference compiled as its sample script compiles it."""
    reference, generate = official_gpt(model, checkout)
    runners = {"LlamaGen generate()": reference}
    if compiled:
        runners["LlamaGen generate(), compiled"] = torch.compile(reference, mode="reduce-overhead", fullgraph=True)
    return {name: image_loop(model, runner, generate) for name, runner in runners.items()}


def image_loop(model: LlamaGenGPT, runner, generate) -> ImageLoop:
    @torch.no_grad()
    def loop(conditioning, sampling: SamplingSettings, generator) -> torch.Tensor:
        if not sampling.use_cfg:
            raise FastARError("LlamaGen's generate() baseline runs with CFG (its sample scripts' setting)")
        labels = conditioning.labels.to(model.device)
        seed_global_generator(generator)
        with warnings.catch_warnings():  # its decode loop enters torch.backends.cuda.sdp_kernel, deprecated since
            warnings.filterwarnings("ignore", message=".*sdp_kernel", category=FutureWarning)  # torch 2.3
            codes = generate.generate(runner, labels, model.grid[0] * model.grid[1], cfg_scale=sampling.cfg_scale,
                                      temperature=sampling.temperature, top_k=sampling.top_k or 0,
                                      top_p=sampling.top_p, sample_logits=sampling.temperature > 0)
        return codes.long()

    return loop
