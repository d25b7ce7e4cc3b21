"""A smaller AR model of the same family and tokenizer as a drafter (e.g. LlamaGen-B for LlamaGen-XL).

Works over any token-AR model: it keeps its own prefilled session (same conditioning, same CFG rows) and
re-feeds the last ``max_window`` fixed tokens at each catch-up, which always covers what the previous
iteration fixed (at most gamma + 1 tokens, or a tree's depth + 1), so no per-row bookkeeping of its cache is
needed: a tree's nodes, grown in the slots after the root, are overwritten by the next catch-up.
"""
from __future__ import annotations

import torch

from ..shared.compiled import compile_like
from ..shared.protocol import ModelOutput


class SmallARDrafter:
    needs_target_hidden = False

    def __init__(self, model, name: str = "small-ar"):
        self.model, self.name = model, name

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def grid(self) -> tuple[int, int]:
        return tuple(self.model.grid)

    def start(self, conditioning, *, cfg: bool, max_window: int, target_session=None,
              tree_nodes: int = 0) -> "SmallARDraftSession":
        """A draft session; its steps compiled when ``target_session``'s are (compiled.py)."""
        compile_like(self.model, target_session)
        session = self.model.start(conditioning, cfg=cfg, max_window=max(max_window, tree_nodes + 1))
        return SmallARDraftSession(session, max_window)


class SmallARDraftSession:
    def __init__(self, session, width: int):
        self.session, self.width = session, width

    def catch_up(self, seq: torch.Tensor, n: torch.Tensor, target: ModelOutput, target_start: torch.Tensor) -> ModelOutput:
        start = (n - self.width).clamp(min=0)
        index = (start.unsqueeze(1) + torch.arange(self.width, device=seq.device)).clamp(max=seq.shape[1] - 1)
        out = self.session.forward(seq.gather(1, index), start)  # slots at or after n are scratch
        return out.pick(n - 1 - start)

    def step(self, tokens: torch.Tensor, position: torch.Tensor) -> ModelOutput:
        return self.session.forward(tokens, position)

    def grow(self, tokens, start, depth, ancestors, parent, first: int) -> ModelOutput:
        return self.session.forward_tree(tokens, start, depth, ancestors, first=first)
