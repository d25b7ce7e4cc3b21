"""When MAR's sampler reuses features (LazyMAR-style, ``model_loaders/mar/lazy.py``), and what that saves.

A generation's steps before ``start_percent`` of them and from ``end_percent`` on are full steps; between
them, one step in ``refresh_every`` is a full step that refills the cache and the others reuse it: the
conditional rows only, the encoder on the newly fixed tokens only, and the decoder's later blocks on the
needed slots plus a ``1 - token_reuse`` share of the others (those whose features moved most). Inside the
diffusion head (every MAR step), one reverse step in ``head_refresh_every`` is a full call; the others compute
the conditional rows only, take each block's MLP output and the guidance gap from it. The names
follow ComfyUI's own caching nodes (start and end percent); the reference's own schedule refreshes every 9th
step after the first 5 of 64 and prunes up to 95% of the slots late in a generation.

Reused steps sample from what the model would say given partly stale features: a relaxed sampler, measured
against plain MAR in the bench, never claimed exact.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from ...errors import FastARError


@dataclass(frozen=True)
class FeatureReuse:
    start_percent: float = 0.1  # on the demo MAR 0.1 kept more quality than 0.2 at the same speed (README)
    end_percent: float = 1.0
    refresh_every: int = 4
    token_reuse: float = 0.75
    head_refresh_every: int = 7  # the diffusion head: a full call every N reverse steps (0: every call in full)

    def validate(self) -> "FeatureReuse":
        if not 0.0 <= self.start_percent < self.end_percent <= 1.0:
            raise FastARError(f"feature reuse from {self.start_percent:g} to {self.end_percent:g} of the steps: give "
                              "0 <= start percent < end percent <= 1 (outside that range every step is computed in "
                              "full)")
        if self.refresh_every < 2:
            raise FastARError(f"refresh every {self.refresh_every}: use 2 or more (a full step every N steps; 1 would "
                              "reuse nothing)")
        if not 0.0 <= self.token_reuse < 1.0:
            raise FastARError(f"token reuse {self.token_reuse:g}: give the share of slots whose later decoder features "
                              "a reusing step keeps from the cache, in [0, 1) (0: recompute them all)")
        if self.head_refresh_every == 1 or self.head_refresh_every < 0:
            raise FastARError(f"head refresh every {self.head_refresh_every}: use 0 (the diffusion head computes every "
                              "reverse step in full) or 2 or more (a full head call every N reverse steps; LazyMAR's 7)")
        return self

    @lru_cache(maxsize=8)  # asked at every MAR step; the settings are frozen, so the answer is too
    def full_steps(self, num_steps: int) -> tuple[bool, ...]:
        """Per step: a full step (True) or one that reuses the cache."""
        start, end = math.ceil(self.start_percent * num_steps), math.ceil(self.end_percent * num_steps)
        return tuple(step < max(start, 1) or step >= end or (step - start) % self.refresh_every == 0
                     for step in range(num_steps))

    def keep(self, slots: int, needed: int) -> int:
        """Slots a reusing step recomputes after the pruning block: the ``needed`` and a share of the rest."""
        return min(slots, needed + math.ceil((slots - needed) * (1.0 - self.token_reuse)))
