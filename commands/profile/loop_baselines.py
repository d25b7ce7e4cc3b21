"""The usual loops FastAR's ``ar`` is timed against (``python -m fastar profile --baselines``), each on the very
weights of the model being profiled, so that one run puts them side by side:

- ``plain loop`` (LlamaGen class-to-image shapes): one token per forward without a static cache or graphs, cond
  and uncond rows in one batch, each layer's keys and values grown by concatenation, ``torch.multinomial`` per
  step: what a loop written from the model's forward alone costs;
- ``LlamaGen generate()`` (LlamaGen class-to-image shapes, given a checkout of the official code): the release's
  own sampling loop, eager and, with ``--compile``, compiled as its sample script compiles it
  (official_llamagen.py);
- ``transformers generate()`` (Janus and Chameleon-family shapes): transformers' own loop
  (transformers_baselines.py).

Each draws the same tokens as FastAR's ``ar`` when decoding is greedy (tests/test_loop_baselines.py,
tests/test_transformers_baselines.py), so the times compare the same work.
"""
from __future__ import annotations

import torch

from ...errors import FastARError
from ...model_loaders.chameleon.model import ChameleonGPT
from ...model_loaders.janus.model import JanusGPT
from ...model_loaders.llamagen.model import LlamaGenGPT, rope_2d_table
from ...model_loaders.shared.protocol import ModelOutput
from ...samplers.processing import SamplingSettings, probabilities
from .common import ImageLoop
from .official_llamagen import official_loops
from .transformers_baselines import chameleon_loop, janus_loop



class GrowingCache:
    """A layer's keys and values, concatenated step by step (the cache of a loop without preallocation)."""

    def __init__(self):
        self.k = self.v = None

    def write(self, k, v, slots, keys=None):  # every key so far, whatever ``keys`` asks
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


@torch.no_grad()
def plain_loop(model: LlamaGenGPT, conditioning, sampling: SamplingSettings, generator) -> torch.Tensor:
    """Codes ``[B, N]`` of a class-to-image LlamaGen, one token per forward with a growing cache."""
    cfg = sampling.use_cfg
    h, _ = model.embed_conditioning(conditioning, cfg)
    rows, cond_len = h.shape[:2]
    table = rope_2d_table(model.grid, model.cfg.head_dim, cond_len, 0, model.cfg.rope_base).to(model.device)
    caches = [GrowingCache() for _ in model.layers]
    hidden = model.run_layers(h, table[None, :cond_len].expand(rows, -1, -1, -1), None, caches)
    codes = []
    for i in range(model.cfg.num_tokens):
        logits = model.output(hidden[:, -1:]).float()
        out = ModelOutput(logits[: len(logits) // 2], logits[len(logits) // 2:]) if cfg else ModelOutput(logits)
        token = torch.multinomial(probabilities(out, sampling)[:, 0], 1, generator=generator)
        codes.append(token)
        fed = torch.cat([token, token]) if cfg else token
        hidden = model.run_layers(model.tok_embeddings(fed), table[cond_len + i].expand(rows, 1, -1, -1), None, caches)
    return torch.cat(codes, dim=1)


def baseline_loops(model, *, llamagen_code=None, compiled: bool = False) -> dict[str, ImageLoop]:
    """The usual loops for ``model``'s family, on its weights, by name (empty where FastAR has none to compare
    with). ``llamagen_code``: a checkout of the official LlamaGen code, whose ``generate()`` then joins them
    (compiled as its sample script does when ``compiled``)."""
    llamagen = isinstance(model, LlamaGenGPT) and model.cfg.model_type == "c2i"
    if llamagen_code is not None and not llamagen:
        raise FastARError(f"--llamagen-code: LlamaGen's generate() is timed on LlamaGen class-to-image models; this "
                          f"is {model.what}")
    if llamagen:
        loops = {"plain loop": lambda conditioning, sampling, generator: plain_loop(model, conditioning, sampling,
                                                                                   generator)}
        if llamagen_code is not None:
            loops |= official_loops(model, llamagen_code, compiled=compiled)
        return loops
    if isinstance(model, JanusGPT):
        return {"transformers generate()": janus_loop(model)}
    if isinstance(model, ChameleonGPT):
        return {"transformers generate()": chameleon_loop(model)}
    return {}
