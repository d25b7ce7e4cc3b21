"""The rows an EAGLE drafter trains on: the target's teacher-forced hidden states paired with the tokens that follow
them, exactly as ``EagleSession`` pairs them while decoding (a test compares the two).

Row t pairs the target's state at drafter slot t with the token after it and should reach the state at slot t + 1.
The first rows replay the prefix (LlamaGen: its conditioning slots with token 0; a layout model: its prompt), then
image row q pairs code q with the state that predicts code q. In a layout with row-end tokens (Lumina-mGPT) a
row's last code is predicted from its row end's state, so the drafter's slots hold image codes only: the row ends
are skipped, and the states paired with codes are the ones the target's session returns for them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..llamagen.model import LlamaGenGPT
from ..shared.llm_decoder import teacher_forced_image
from ..shared.protocol import PromptConditioning


@dataclass
class TeacherRows:
    ids: torch.Tensor  # [B, T] the drafter's input token ids
    hidden: torch.Tensor  # [B, T, D] the target states paired with them
    valid: torch.Tensor  # [B, P] which replayed prefix rows are real ([B, 0]: none is padding)
    shift: torch.Tensor | None  # [B] each row's left padding (a layout model's RoPE counts from its first real token)
    following: torch.Tensor  # [B, N - 1, D] the target states the image rows should reach (predicting codes 1..N-1)


@torch.no_grad()
def teacher_rows(target, token_ids, conditioning, tokens: torch.Tensor, drop: torch.Tensor) -> TeacherRows:
    """The rows of images ``tokens`` [B, N] under ``conditioning``; rows where ``drop`` [B] is true see the target's
    unconditional context (CFG's second pass). ``token_ids`` maps codes to the drafter's input ids."""
    if isinstance(target, LlamaGenGPT):
        hidden = target.training_hidden(conditioning, tokens, drop)  # [B, C + N - 1, D]
        replayed = hidden.shape[1] - tokens.shape[1]  # C - 1 conditioning rows
        ids = torch.cat([tokens.new_zeros(tokens.shape[0], replayed), tokens[:, :-1]], 1)
        return TeacherRows(ids, hidden[:, :-1], torch.ones(tokens.shape[0], 0, dtype=torch.bool, device=tokens.device),
                           None, hidden[:, replayed + 1:])
    if not isinstance(conditioning, PromptConditioning):
        raise TypeError(f"{target.what} trains drafters on PromptConditioning")
    prompts = target.prompts.encode(conditioning)
    both = target.prefixes(prompts, cfg=True)
    prefixes = [both[len(prompts) + b] if dropped else both[b] for b, dropped in enumerate(drop.tolist())]
    hidden, ids, valid, image_slots = teacher_forced_image(target, prefixes, tokens)
    predicting = hidden[:, image_slots - 1]  # the state before each code's slot (a row end's for a row's first code)
    P = ids.shape[1]
    return TeacherRows(torch.cat([ids[:, 1:], token_ids(tokens[:, :-1])], 1),
                       torch.cat([hidden[:, :P - 1], predicting[:, :-1]], 1), valid[:, :-1],
                       (~valid).sum(1), predicting[:, 1:])
