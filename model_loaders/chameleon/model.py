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

from ..shared.llm_decoder import DecoderConfig, ImageLayout, VocabularyImageGPT


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
    def image_suffix(self) -> list[int]:
        """What the model writes after the image."""
        return [self.eoi]

    @property
    def uncond_prefix(self) -> list[int]:
        """What CFG's unconditional rows see before the image: the image prefix, after bos for Anole."""
        return ([self.bos] if self.uncond_bos and self.bos is not None else []) + self.image_prefix


class ChameleonGPT(VocabularyImageGPT):
    """A Chameleon-family model behind the token-AR protocol (image codes in, image-code logits out)."""

    def __init__(self, cfg: ChameleonConfig, prompts=None, what: str = "a Chameleon-family model"):
        super().__init__(cfg, cfg.decoder, ImageLayout(cfg.grid, cfg.row_end, cfg.eoi), prompts, what)

    def prefixes(self, prompts: list[list[int]], cfg: bool) -> list[list[int]]:
        """Each row's tokens before its image: cond rows, then CFG's uncond rows (``uncond_prefix``)."""
        rows = [p + self.cfg.image_prefix for p in prompts]
        return rows + [self.cfg.uncond_prefix] * len(prompts) if cfg else rows
