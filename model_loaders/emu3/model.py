"""Emu3's text-to-image transformer: a LLaMA-family decoder (``llm_decoder``: GQA, no QK norm, no biases, RoPE base
1e6) whose image codes are vocabulary entries (``<|visual token NNNNNN|>``).

The layout (BAAI's processor and prefix-constrained function; transformers' ``Emu3Processor`` builds the same):
bos, the prompt, ``<|image start|>``, the grid as text ``"{h}*{w}"`` (height first), ``<|image token|>``; then the
image tokens in raster order, each row followed by the row end ``<|extra_200|>`` (the last row too), then
``<|extra_201|>``, ``<|image end|>``, eos. The sampler sees image codes only; the session feeds the row ends
itself. CFG guides against a negative prompt that carries the same image header (BAAI's ``image_generation.py``):
each unconditional row is bos, the negative prompt, the image header, then every token the conditional row is fed
(row ends included). Rows are left-padded to a common prefix, their positions counted from their first real token.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..shared.llm_decoder import DecoderConfig, ImageLayout, VocabularyImageGPT


@dataclass
class Emu3Config:
    decoder: DecoderConfig
    image_ids: list[int]  # the vocabulary id of image code k, for k = 0..codes-1
    grid: tuple[int, int]  # (rows, columns) of image tokens
    bos: int
    boi: int  # <|image start|>
    image_token: int  # <|image token|>: after the size text, the image's first token follows it
    row_end: int  # <|extra_200|>
    eof: int  # <|extra_201|>: after the last row end
    eoi: int  # <|image end|>
    eos: int
    size_ids: list[int] = field(default_factory=list)  # the tokens of "{h}*{w}"
    negative_ids: list[int] = field(default_factory=list)  # the default negative prompt's tokens (without bos)

    def __post_init__(self):
        self.grid = tuple(self.grid)

    @property
    def image_prefix(self) -> list[int]:
        """The image header every row ends its prefix with, the unconditional rows' too."""
        return [self.boi, *self.size_ids, self.image_token]

    @property
    def image_suffix(self) -> list[int]:
        """What the model writes after the last row end."""
        return [self.eof, self.eoi, self.eos]


class Emu3GPT(VocabularyImageGPT):
    """Emu3 behind the token-AR protocol (image codes in, image-code logits out)."""

    takes_negative_prompt = True
    # the release's sampling (BAAI's image_generation.py; the SJD reference's test_emu3.py): what the front ends take
    # where the user gives no value (settings.sampling_from reads them from ``defaults``)
    release_defaults = {"cfg": 3.0, "top_k": 2048}

    def __init__(self, cfg: Emu3Config, prompts=None, what: str = "an Emu3 model"):
        super().__init__(cfg, cfg.decoder, ImageLayout(cfg.grid, cfg.row_end, cfg.eos), prompts, what)

    def uncond_of(self, conditioning) -> dict:
        return {"negatives": self.prompts.encode_negative(conditioning)}

    def prefixes(self, prompts: list[list[int]], cfg: bool, negatives: list[list[int]] | None = None) -> list[list[int]]:
        """Each row's tokens before its image: the prompts (bos included) and the image header, then under CFG the
        negative prompts (bos included; default: bos and the model's negative prompt) and the same header."""
        header = self.cfg.image_prefix
        rows = [list(p) + header for p in prompts]
        if not cfg:
            return rows
        negatives = negatives or [[self.cfg.bos, *self.cfg.negative_ids]] * len(prompts)
        if len(negatives) != len(prompts):
            raise ValueError(f"{len(negatives)} negative prompts for {len(prompts)} rows")
        return rows + [list(n) + header for n in negatives]
