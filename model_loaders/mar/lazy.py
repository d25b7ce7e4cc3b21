"""LazyMAR-style feature reuse for a MAR transformer (Yan et al., ICCV 2025; the facts from the paper and
feihongyan1/LazyMAR, the code written here): between full steps, a step computes the conditional rows only,
and only the part of them that changes.

- Condition redundancy: the unconditional condition vectors are the conditional ones plus the gap the last
  full step measured between the two.
- Token redundancy in the encoder: only the buffer and the tokens fixed since the last call go through it;
  they attend to the keys and values the other known tokens left in the cache, whose own encodings are kept.
- Token redundancy in the decoder: every slot goes through the blocks up to ``prune_block``; there, how much
  each slot's values moved since the last call (cosine similarity, mean over heads) ranks the slots, and the
  later blocks recompute only the ``keep`` slots that moved most, taking the others' keys and values from the
  cache. The positions whose condition vectors the step needs, and those fixed at the step before, are
  always recomputed.
The cache holds the conditional rows only: batch x (encoder and decoder keys and values, the decoder's
input) per slot, and the guidance gap.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .model import Trace, gather_slots

PRUNE_FRACTION = 3 / 16  # the reference prunes after decoder block 3 of MAR-L's 16


@dataclass
class KeysValues:
    """One block's keys and values ``[B, heads, slots, head_dim]`` per slot."""

    keys: torch.Tensor
    values: torch.Tensor

    def put(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``keys`` and ``values`` of ``slots`` [B, n]."""
        index = slots[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[3])
        self.keys.scatter_(2, index, keys)
        self.values.scatter_(2, index, values)


def prune_block(depth: int) -> int:
    """The decoder block after whose attention the slots are ranked and pruned."""
    return min(depth - 1, round(depth * PRUNE_FRACTION))


class LazyFeatures:
    """The reusable features of one generation of one MAR model."""

    def __init__(self, model):
        self.model = model
        self.prune_block = prune_block(self.decoder_depth)
        self.encoder_kv: list[KeysValues] = []
        self.decoder_kv: list[KeysValues] = []
        self.encoder_seen = self.decoder_input = self.gap = None

    @property
    def decoder_depth(self) -> int:
        return len(self.model.decoder_blocks)

    @property
    def slots(self) -> int:
        return self.model.cfg.buffer + self.model.cfg.num_tokens

    def full_work(self, known: int, rows: int) -> int:
        """A plain call's transformer work in slot-blocks (one slot through one block): ``rows`` (2 under CFG)
        x the buffer and the known tokens through the encoder, every slot through the decoder."""
        cfg = self.model.cfg
        return rows * ((cfg.buffer + known) * len(self.model.encoder_blocks) + self.slots * self.decoder_depth)

    def reused_work(self, fresh: int, keep: int) -> int:
        """A reusing call's: one row, the buffer and ``fresh`` tokens through the encoder, every slot through
        the blocks up to the pruning one, ``keep`` slots after it."""
        through = self.prune_block + 1
        return ((self.model.cfg.buffer + fresh) * len(self.model.encoder_blocks) + self.slots * through
                + keep * (self.decoder_depth - through))

    def refresh(self, tokens, known, cond, uncond, known_count: int):
        """A full step (``MAR.conditions`` on cond and, under CFG, uncond rows) that refills the cache:
        condition vectors ``(z_cond, z_uncond)``, each ``[B, L, D]`` (z_uncond None without CFG)."""
        B = tokens.shape[0]
        trace = Trace()
        if uncond is None:
            z_cond, z_uncond = self.model.conditions(tokens, known, cond, known_count, trace), None
        else:
            z = self.model.conditions(torch.cat([tokens, tokens]), torch.cat([known, known]),
                                      torch.cat([cond, uncond]), known_count, trace)
            z_cond, z_uncond = z.chunk(2)
        self.gap = None if z_uncond is None else z_uncond - z_cond
        kept = trace.kept[:B]
        self.encoder_kv = []
        for keys, values in trace.encoder:
            shape = (B, keys.shape[1], self.slots, keys.shape[3])
            cache = KeysValues(keys.new_zeros(shape), values.new_zeros(shape))
            cache.put(kept, keys[:B], values[:B])
            self.encoder_kv.append(cache)
        self.encoder_seen = torch.zeros(B, self.slots, dtype=torch.bool, device=known.device).scatter_(1, kept, True)
        self.decoder_input = trace.decoder_input[:B].clone()
        self.decoder_kv = [KeysValues(keys[:B].clone(), values[:B].clone()) for keys, values in trace.decoder]
        return z_cond, z_uncond

    def reuse(self, tokens, cond, fresh: torch.Tensor, needed: torch.Tensor, keep: int):
        """A cached step: condition vectors ``(z_cond, z_uncond)`` valid at ``needed`` [B, m] (elsewhere they
        are not computed). ``fresh`` [B, n]: the positions fixed since the last call; ``keep``: how many slots
        the blocks after the pruning one recompute (at least the m needed and the n fresh ones)."""
        model, buffer = self.model, self.model.cfg.buffer
        B = tokens.shape[0]
        slots = torch.cat([torch.arange(buffer, device=fresh.device).expand(B, -1), fresh + buffer], dim=1)
        self.encoder_seen.scatter_(1, slots, True)
        x = gather_slots(model.encoder_input(tokens, cond), slots)
        for block, cache in zip(model.encoder_blocks, self.encoder_kv):
            q, k, v = block.attn.project(block.norm1(x))
            cache.put(slots, k, v)
            x = x + block.attn.mix(q, cache.keys, cache.values, self.encoder_seen)
            x = x + block.mlp(block.norm2(x))
        encoded = model.encoded_out(x) + gather_slots(model.decoder_pos_embed_learned.expand(B, -1, -1), slots)
        self.decoder_input.scatter_(1, slots.unsqueeze(-1).expand(-1, -1, encoded.shape[-1]), encoded)
        x, active = self.decoder_input, None
        for index, (block, cache) in enumerate(zip(model.decoder_blocks, self.decoder_kv)):
            q, k, v = block.attn.project(block.norm1(x))
            if active is None:  # every slot: its keys and values are all fresh
                moved = F.cosine_similarity(v, cache.values, dim=-1).mean(1) if index == self.prune_block else None
                cache.keys, cache.values = k, v
                x = x + block.attn.mix(q, k, v)
                if moved is not None:
                    active = self.most_moved(moved, fresh, needed, keep)
                    x = gather_slots(x, active)
            else:
                cache.put(active, k, v)
                x = x + block.attn.mix(q, cache.keys, cache.values)
            x = x + block.mlp(block.norm2(x))
        full = x.new_zeros(B, self.slots, x.shape[-1]).scatter(1, active.unsqueeze(-1).expand(-1, -1, x.shape[-1]), x)
        z_cond = model.conditions_out(full)
        return z_cond, None if self.gap is None else z_cond + self.gap

    def most_moved(self, similarity: torch.Tensor, fresh, needed, keep: int) -> torch.Tensor:
        """``[B, keep]``: the slots whose values moved most (lowest similarity), the needed and fresh first."""
        buffer = self.model.cfg.buffer
        similarity = similarity.scatter(1, torch.cat([fresh, needed], dim=1) + buffer, -2.0)  # below any cosine
        return torch.topk(similarity, keep, dim=1, largest=False).indices
