"""Chameleon-family transformers (Lumina-mGPT, Anole): a LLaMA-family decoder (``llm_decoder``) with
per-head QK norm, whose image tokens are vocabulary entries.

The layout: a prompt (its own tokens, from the adapter's tokenizer), ``boi``, the size tokens
(Lumina-mGPT: height and width in 32-pixel units), then the image tokens in raster order, each row
followed by ``row_end`` (Lumina-mGPT; Anole has none). The sampler sees image codes only: logits are the
image tokens' columns in code order (``image_ids``, read from the vocabulary map), layout tokens are fed
by the session itself, and a window that crosses a row end carries the row-end token inside it. CFG's
unconditional rows start at ``boi`` (Lumina-mGPT's second pass) or at bos, boi (Anole, as Meta's image
decoder and LANTERN build them). Rows are left-padded to a common prefix,
their positions counted from their first real token.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..shared.llm_decoder import Backbone, DecoderConfig, ImageLayout, LayoutSession, cache_slots


@dataclass
class ChameleonConfig:
    hidden_size: int
    n_layer: int
    n_head: int
    n_kv_head: int
    ffn_hidden: int
    vocab_size: int
    image_ids: list[int]  # the vocabulary id of image code k, for k = 0..codes-1
    boi: int
    eoi: int
    grid: tuple[int, int]
    row_end: int | None = None  # Lumina-mGPT: the token after every row of image tokens
    size_ids: list[int] = field(default_factory=list)  # fed right after boi (Lumina-mGPT: height, width)
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    swin_norm: bool = False
    bos: int | None = 0
    qk_norm_rows: tuple[int, int] | None = None  # None: per head; else per model-parallel shard (Lumina-mGPT)
    uncond_bos: bool = False  # Anole: CFG's unconditional rows are [bos, boi] (Lumina-mGPT's start at boi)

    def __post_init__(self):
        self.grid = tuple(self.grid)

    @property
    def decoder(self) -> DecoderConfig:
        return DecoderConfig(self.hidden_size, self.n_layer, self.n_head, self.n_kv_head, self.ffn_hidden,
                             self.vocab_size, self.rope_theta, self.rms_eps, qk_norm=True,
                             qk_norm_rows=self.qk_norm_rows, swin_norm=self.swin_norm)

    @property
    def num_tokens(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def image_prefix(self) -> list[int]:
        """What every image starts with."""
        return [self.boi, *self.size_ids]

    @property
    def uncond_prefix(self) -> list[int]:
        """What CFG's unconditional rows see before the image: the image prefix, after bos for Anole."""
        return ([self.bos] if self.uncond_bos and self.bos is not None else []) + self.image_prefix


class ChameleonGPT(nn.Module):
    """A Chameleon-family model behind the token-AR protocol (image codes in, image-code logits out)."""

    kind = "token-ar"
    conditioning_kind = "prompt"  # it tokenises prompts with its own tokenizer

    def __init__(self, cfg: ChameleonConfig, prompts=None, what: str = "a Chameleon-family model"):
        super().__init__()
        self.cfg, self.what = cfg, what
        self.prompts = prompts  # turns PromptConditioning into token ids (the model's own tokenizer)
        self.decoder_cfg, self.layout = cfg.decoder, ImageLayout(cfg.grid, cfg.row_end, cfg.eoi)
        self.model = Backbone(self.decoder_cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("image_ids", torch.tensor(cfg.image_ids, dtype=torch.long), persistent=False)
        self.image_rows_only = False  # lm_head keeps only the image codes' rows (keep_image_rows)

    # -- protocol -----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self.cfg.image_ids)

    @property
    def grid(self) -> tuple[int, int]:
        return self.cfg.grid

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def decoder_input(self, codes: torch.Tensor) -> torch.Tensor:
        return codes.view(-1, *self.grid)

    def code_embeddings(self) -> torch.Tensor:
        return self.model.embed_tokens.weight[self.image_ids]

    def image_sequence(self, codes: torch.Tensor) -> list[int]:
        """The vocabulary ids of one image as the model writes it: boi, size tokens, the rows (each ended by
        the row-end token where the layout has one), eoi."""
        ids = self.image_ids[codes.to(self.image_ids.device)].view(self.grid).tolist()
        ends = [self.cfg.row_end] if self.cfg.row_end is not None else []
        return [*self.cfg.image_prefix, *(t for row in ids for t in row + ends), self.cfg.eoi]

    @property
    def backbone(self) -> Backbone:
        return self.model

    def embed_images(self, codes: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(self.image_ids[codes])

    def image_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over image codes only (the image tokens' rows of the output head), fp32."""
        weight = self.lm_head.weight if self.image_rows_only else self.lm_head.weight[self.image_ids]
        return F.linear(hidden, weight).float()

    def keep_image_rows(self) -> None:
        """Drop the output head's text rows, once (the loader does): only image codes are ever predicted, and
        gathering their rows at every forward copied 64 MB per step at 7B; the text rows are 0.45 GB of memory."""
        self.lm_head.weight = nn.Parameter(self.lm_head.weight[self.image_ids], requires_grad=False)
        self.image_rows_only = True

    @torch.no_grad()
    def start(self, conditioning, *, cfg: bool, max_window: int, hidden: bool = False) -> LayoutSession:
        if self.prompts is None:
            raise TypeError("this model was built without a tokenizer: start a session with start_ids")
        cond = self.prompts.encode(conditioning)
        return self.start_ids(cond, cfg=cfg, max_window=max_window, hidden=hidden)

    def start_ids(self, prompts: list[list[int]], *, cfg: bool, max_window: int, hidden: bool = False):
        """A session for rows whose prompts are ``prompts`` (token ids, without the image prefix)."""
        return LayoutSession(self, self.prefixes(prompts, cfg), len(prompts), cfg=cfg, max_window=max_window,
                             hidden=hidden)

    def prefixes(self, prompts: list[list[int]], cfg: bool) -> list[list[int]]:
        """Each row's tokens before its image: cond rows, then CFG's uncond rows (``uncond_prefix``)."""
        rows = [p + self.cfg.image_prefix for p in prompts]
        return rows + [self.cfg.uncond_prefix] * len(prompts) if cfg else rows

    def cache_slots(self, conditioning, max_window: int) -> int:
        """The KV cache length a session for ``conditioning`` allocates (for memory estimates)."""
        longest = max(len(p) for p in self.prefixes(self.prompts.encode(conditioning), cfg=False))
        return cache_slots(self.layout, longest, max_window)
