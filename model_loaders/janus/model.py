"""Janus / Janus-Pro's image generation path: a LLaMA decoder (``llm_decoder``, no QK norm) whose image tokens
have their own input path and output head.

- input: ``gen_embed`` (code -> 8-wide vector) then ``gen_aligner`` (Linear, then GELU + Linear per further
  layer) to the LLM's width;
- output: ``gen_head`` (Linear, GELU, Linear to the codes) on the final-norm hidden state;
- layout: the prompt's tokens ending with ``<begin_of_image>``, then 24 x 24 image tokens (384 px), no row
  or end tokens. CFG's unconditional rows keep the prompt's length with every token but bos and
  ``<begin_of_image>`` replaced by the pad token (and attended to), as the official sampler builds them.
Internal names follow transformers' conversion (``gen_aligner.fc1``, ``gen_aligner.hidden_layers.{i}``,
``gen_head.proj_out``, ``gen_head.vision_head``); the loader renames DeepSeek's original layout to them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..shared.llm_decoder import Backbone, DecoderConfig, ImageLayout, LayoutSession, cache_slots


@dataclass
class JanusConfig:
    decoder: DecoderConfig
    codes: int  # image codebook size (16384)
    code_width: int  # gen_embed's width (8)
    aligner_layers: int  # gen_aligner: Linear layers (2)
    head_width: int  # gen_head's hidden width
    grid: tuple[int, int]
    pad: int  # the token that replaces the prompt in CFG's unconditional rows
    bos: int | None
    boi: int

    def __post_init__(self):
        self.grid = tuple(self.grid)


class Aligner(nn.Module):
    def __init__(self, cin: int, width: int, layers: int):
        super().__init__()
        self.fc1 = nn.Linear(cin, width)
        self.hidden_layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers - 1))

    def forward(self, x):
        x = self.fc1(x)
        for layer in self.hidden_layers:
            x = layer(F.gelu(x))
        return x


class GenerationHead(nn.Module):
    def __init__(self, dim: int, width: int, codes: int):
        super().__init__()
        self.proj_out = nn.Linear(dim, width)
        self.vision_head = nn.Linear(width, codes)

    def forward(self, hidden):
        return self.vision_head(F.gelu(self.proj_out(hidden)))


class JanusGPT(nn.Module):
    """Janus's image generation behind the token-AR protocol."""

    kind = "token-ar"
    conditioning_kind = "prompt"
    holds_image_decoder = True  # the release folder has the VQ (load_image_decoder on the folder finds it)

    def __init__(self, cfg: JanusConfig, prompts=None, what: str = "a Janus-Pro model"):
        super().__init__()
        self.cfg, self.what, self.prompts = cfg, what, prompts
        self.decoder_cfg, self.layout = cfg.decoder, ImageLayout(cfg.grid, None, cfg.pad)
        self.language_model = Backbone(cfg.decoder)
        self.gen_embed = nn.Embedding(cfg.codes, cfg.code_width)
        self.gen_aligner = Aligner(cfg.code_width, cfg.decoder.hidden_size, cfg.aligner_layers)
        self.gen_head = GenerationHead(cfg.decoder.hidden_size, cfg.head_width, cfg.codes)

    @property
    def vocab_size(self) -> int:
        return self.cfg.codes

    @property
    def grid(self) -> tuple[int, int]:
        return self.cfg.grid

    @property
    def device(self) -> torch.device:
        return self.gen_embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.gen_embed.weight.dtype

    @property
    def backbone(self) -> Backbone:
        return self.language_model

    def decoder_input(self, codes: torch.Tensor) -> torch.Tensor:
        return codes.view(-1, *self.grid)

    def code_embeddings(self) -> torch.Tensor:
        """What the LLM reads for each code (the aligned embeddings)."""
        return self.gen_aligner(self.gen_embed.weight)

    def embed_images(self, codes: torch.Tensor) -> torch.Tensor:
        return self.gen_aligner(self.gen_embed(codes))

    def image_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.gen_head(hidden).float()

    @torch.no_grad()
    def start(self, conditioning, *, cfg: bool, max_window: int, hidden: bool = False) -> LayoutSession:
        if self.prompts is None:
            raise TypeError("this model was built without a tokenizer: start a session with start_ids")
        return self.start_ids(self.prompts.encode(conditioning), cfg=cfg, max_window=max_window, hidden=hidden)

    def start_ids(self, prompts: list[list[int]], *, cfg: bool, max_window: int, hidden: bool = False):
        """A session for rows whose prompts are ``prompts`` (token ids ending with ``<begin_of_image>``)."""
        return LayoutSession(self, self.prefixes(prompts, cfg), len(prompts), cfg=cfg, max_window=max_window,
                             hidden=hidden)

    def prefixes(self, prompts: list[list[int]], cfg: bool) -> list[list[int]]:
        """Cond rows, then CFG's uncond rows: the same length, all pad but bos and ``<begin_of_image>``."""
        rows = [list(p) for p in prompts]
        keep = {self.cfg.bos, self.cfg.boi}
        return rows + [[t if t in keep else self.cfg.pad for t in p] for p in prompts] if cfg else rows

    def cache_slots(self, conditioning, max_window: int) -> int:
        """The KV cache length a session for ``conditioning`` allocates (for memory estimates)."""
        return cache_slots(self.layout, max(map(len, self.prompts.encode(conditioning))), max_window)
