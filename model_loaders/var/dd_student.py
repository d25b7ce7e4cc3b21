"""VAR-DD students (Distilled Decoding, microsoft/distilled_decoding, ``VAR-DD/var-d{16,20,24}.pth``): a VAR that
reads every scale's tokens as continuous vectors (noise, or code vectors for the scales given as data) and
predicts all of them in one forward.

Key names follow the release (weights under ``["trainer"]["ema_parameters"]``); the math, each point pinned by a
test:
- the scales are the teacher's with an extra leading 1 (``patch_nums`` 1, 1, 2, ... 16: 681 slots): slot 0 is the
  class embedding plus ``pos_start``, slots 1..680 read ``word_embed`` of the 680 token vectors (scale by scale, in
  the teacher's order); every slot adds its level's ``lvl_embed`` and its ``pos_1LC`` row;
- ``n_d_embed`` row 1 ("data") on slots before ``1 + t`` (slot 0 included; t = the tokens given as data), row 0
  elsewhere, added to the input; block i adds ``layerwise_n_d_embed[i]`` of it between its attention and its FFN,
  and the heads read the output plus ``layerwise_n_d_embed[depth]`` of it;
- attention sees the strictly earlier levels and the slot itself (not the other tokens of its own scale);
- slot j + 1 predicts token j: logits by the teacher's ``head_nm``/``head``; the continuous head
  ``final_layer_conti``: LayerNorm without affine, ``* (1 + scale) + shift`` with ``(shift, scale) =
  scale_shift_table + c`` (c the raw class embedding: shift first, unlike ``head_nm``), then ``linear``;
- no CFG (the teacher's guidance is baked in).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..dd.student import ContinuousHead
from .model import VAR, VARConfig, additive_mask, level_ids

# The released students' second-step data and split, in teacher scales, by depth: d16 5 scales (55 tokens),
# d20 and d24 4 scales (30 tokens).
OFFICIAL_SCALES = {16: 5, 20: 4, 24: 4}


@dataclass
class VARDDConfig(VARConfig):
    """``patch_nums`` are the teacher's (the student adds the leading 1 itself)."""

    t2: int | None = 55  # tokens given as data at the second step (None: unknown, the DD run must give it)
    split: int | None = 55  # greedy codes before it, continuous outputs from it (None: as t2)
    teacher: str = ""  # fingerprint of the teacher distill-dd distilled it from (empty for released students)
    unknown_split: str = ""  # why t2 and split are unknown (a student of no released size without split_t)

    def student(self) -> VARConfig:
        fields = {k: getattr(self, k) for k in VARConfig.__dataclass_fields__}
        return VARConfig(**{**fields, "patch_nums": (1, *self.patch_nums)})


def dd_mask(patch_nums) -> torch.Tensor:
    """``[L, L]`` bool: slot i sees slot j iff j's level is strictly earlier, or j is i."""
    levels = level_ids(patch_nums)
    return (levels[:, None] > levels[None, :]) | torch.eye(len(levels), dtype=torch.bool)


class VARDDStudent(VAR):
    kind = "few-step"
    what = "a Distilled Decoding student (VAR-DD)"

    def __init__(self, cfg: VARDDConfig):
        super().__init__(cfg.student())
        self.attn_bias_for_masking.copy_(additive_mask(dd_mask(self.cfg.patch_nums)))
        self.n_d_embed = nn.Embedding(2, cfg.dim)
        self.layerwise_n_d_embed = nn.ModuleList(nn.Linear(cfg.dim, cfg.dim) for _ in range(cfg.depth + 1))
        self.final_layer_conti = ContinuousHead(cfg.dim, cfg.channels)  # the same head as LlamaGen-DD's
        self.cfg = cfg  # the teacher's scales, t2, split: what the DD sampler reads

    @property
    def num_tokens(self) -> int:
        return self.cfg.seq_len

    @property
    def teacher_sampler(self) -> tuple[str, int]:
        return "VAR", len(self.cfg.patch_nums)  # one forward per scale

    def decoder_input(self, latents: torch.Tensor) -> torch.Tensor:
        """Every scale's vectors ``[B, 680, C]``, as they are: the VQVAE accumulates them into f_hat."""
        return latents

    def predict(self, x: torch.Tensor, labels: torch.Tensor, t) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` [B, N, C] whose first ``t`` tokens are data (an int, or one per row) -> (continuous [B, N, C],
        logits [B, N, V]), fp32."""
        labels = labels.to(self.device)
        cond = self.class_emb(labels)
        h = torch.cat([cond[:, None] + self.pos_start, self.word_embed(x.to(self.device, self.dtype))], dim=1)
        h = h + self.level_positions()
        t = torch.as_tensor(t, device=self.device).view(-1, 1)
        is_data = torch.arange(h.shape[1], device=self.device)[None] < 1 + t
        n_d = self.n_d_embed(is_data.long())
        h = h + n_d
        mask = self.attn_bias_for_masking[0, 0] == 0
        for block, layerwise in zip(self.blocks, self.layerwise_n_d_embed):
            h = block(h, cond, mask, between=layerwise(n_d))
        h = h + self.layerwise_n_d_embed[-1](n_d)
        return self.final_layer_conti(h[:, 1:], cond[:, None]).float(), self.logits(h[:, 1:], cond)
