"""LlamaGen-DD students (Distilled Decoding, microsoft/distilled_decoding): a LlamaGen GPT that reads a
whole sequence of continuous tokens (noise or code vectors) and predicts every final token in one forward.

Key names follow the released files; the math, each point pinned by a test:
- input slots ``[class embedding, tok_embeddings(x_j) for j in 0..N-1]`` with ``tok_embeddings`` a
  ``Linear(C -> dim)`` with bias; ``n_d_embed`` row 1 is added on slots ``s <= t`` (slot 0 is the class, so
  image position j counts as data iff ``j < t``), row 0 elsewhere;
- the teacher's blocks, 2-D RoPE (zero table at the class slot) and plain causal attention;
- the output at slot ``j + 1`` predicts image token j itself (no one-slot shift as in the teacher);
- logits = ``output(norm(h))``; the continuous head reads h *before* the final norm: LayerNorm without affine
  (eps 1e-6), times ``1 + scale_shift_table[1] + c``, plus ``scale_shift_table[0] + c`` (c the raw class
  embedding), then ``linear`` (dim -> C).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import FastARError
from ..llamagen.model import LabelEmbedding, LlamaGenConfig, TransformerBlock, rope_2d_table
from ..shared.joined import parted_state_dict
from ..shared.transformer import RMSNorm

# The split points of the released students, by (layers, width): positions before it take the logits'
# greedy code, the others the continuous output.
OFFICIAL_SPLITS = {(12, 768): 80, (24, 1024): 130}
DEFAULT_T2 = 80  # the released students' second step


@dataclass
class DDStudentConfig(LlamaGenConfig):
    channels: int = 8  # code vector width (LlamaGen's VQ-16: 8)
    split: int | None = 80  # None: a student of no released size whose files do not say (the run must)
    t2: int = DEFAULT_T2
    unknown_split: str = ""  # why the split is unknown
    teacher: str = ""  # fingerprint of the teacher distill-dd distilled it from (empty for released students)


class ContinuousHead(nn.Module):
    """``final_layer_conti``: an adaLN final layer modulated by the class embedding."""

    def __init__(self, dim: int, channels: int):
        super().__init__()
        self.linear = nn.Linear(dim, channels)
        self.scale_shift_table = nn.Parameter(torch.zeros(2, dim))

    def forward(self, h: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        shift, scale = self.scale_shift_table[0] + cond, self.scale_shift_table[1] + cond
        normed = F.layer_norm(h, (h.shape[-1],), eps=1e-6)
        return self.linear(normed * (1 + scale) + shift)


class DDStudent(nn.Module):
    kind = "few-step"
    what = "a Distilled Decoding student (LlamaGen-DD)"

    def __init__(self, cfg: DDStudentConfig):
        super().__init__()
        if cfg.model_type != "c2i":
            raise ValueError("Distilled Decoding students are class-to-image (the released ones and FastAR's)")
        if cfg.dim % cfg.n_head or cfg.n_head % cfg.n_kv_head or cfg.head_dim % 4:
            raise ValueError(f"inconsistent head layout: dim {cfg.dim}, {cfg.n_head} heads, {cfg.n_kv_head} kv heads")
        self.cfg = cfg
        self.cls_embedding = LabelEmbedding(cfg.num_classes, cfg.dim)
        self.tok_embeddings = nn.Linear(cfg.channels, cfg.dim)
        self.n_d_embed = nn.Embedding(2, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.final_layer_conti = ContinuousHead(cfg.dim, cfg.channels)

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def grid(self) -> tuple[int, int]:
        return self.cfg.grid

    @property
    def num_tokens(self) -> int:
        """Tokens the student predicts (the noise's length)."""
        return self.cfg.grid[0] * self.cfg.grid[1]

    @property
    def teacher_sampler(self) -> tuple[str, int]:
        return "AR", self.num_tokens - 1  # one forward per token after the first

    @property
    def device(self) -> torch.device:
        return self.output.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.output.weight.dtype

    def check_teacher(self, teacher) -> None:
        """``teacher`` must be this student's: the same codes, grid and classes (and, for a student that
        recorded its teacher's fingerprint, that very model)."""
        same = (teacher.vocab_size, tuple(teacher.grid), getattr(teacher.cfg, "num_classes", None)) == \
            (self.vocab_size, tuple(self.grid), self.cfg.num_classes)  # a text-to-image model has no classes
        if not same or (self.cfg.teacher and self.cfg.teacher != model_fingerprint(teacher)):
            raise FastARError("this teacher is not the student's: give the model the student was distilled from "
                              "(same codes, grid and classes)")

    def decoder_input(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``[B, N, C]`` in raster order -> the VQ decoder's input ``[B, C, h, w]``, as they are."""
        return latents.float().transpose(1, 2).reshape(latents.shape[0], -1, *self.grid)

    def predict(self, x: torch.Tensor, labels: torch.Tensor, t) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over the whole sequence ``x`` [B, N, C] whose first ``t`` positions are data (``t`` an
        int, or one per row [B]): the continuous prediction ``[B, N, C]`` and the logits ``[B, N, V]`` of
        every final token, fp32."""
        B, N, _ = x.shape
        cond = self.cls_embedding(labels.to(self.device))
        h = torch.cat([cond, self.tok_embeddings(x.to(self.device, self.dtype))], dim=1)
        t = torch.as_tensor(t, device=self.device).view(-1, 1)
        is_data = torch.arange(N + 1, device=self.device)[None] <= t
        h = h + self.n_d_embed(is_data.long())
        rope = rope_2d_table(self.grid, self.cfg.head_dim, 1, 0, self.cfg.rope_base).to(self.device)
        causal = torch.ones(N + 1, N + 1, dtype=torch.bool, device=self.device).tril()
        for layer in self.layers:
            h = layer(h, rope[None].expand(B, -1, -1, -1), causal)
        logits = self.output(self.norm(h[:, 1:])).float()
        return self.final_layer_conti(h[:, 1:], cond).float(), logits


def model_fingerprint(model: nn.Module) -> str:
    """A short hash of a model's sizes and output head: what a student records of its teacher, telling one
    teacher from another without reading all of a large model's weights back to the host."""
    digest = hashlib.sha256()
    for name, tensor in parted_state_dict(model).items():  # the checkpoint's names: the same however layers run
        digest.update(f"{name}{tuple(tensor.shape)}".encode())
    head = model.output if hasattr(model, "output") else model.head  # LlamaGen's logits head, or VAR's
    digest.update(head.weight.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]
