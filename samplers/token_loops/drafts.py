"""Where Jacobi drafts come from: initialisation of new window slots, and the coupling that turns the
current outputs into next iteration's drafts.

Every draft carries the distribution ``q`` it was drawn from (one-hot for copies), which is what
keeps verification exact. A carried draft always stores the *current* p as its q.
"""
from __future__ import annotations

import torch

from ...errors import check_choice
from .acceptance import ExactRule, positive_residual
from ..processing import counter_gumbel, counter_key, random_codes, sample, uniform

INIT_STRATEGIES = ("random", "horizontal", "vertical", "sample-left", "sample-above")
COUPLINGS = ("independent", "maximal", "gumbel")


class DraftSource:
    """Drafts for one Jacobi generation of ``batch`` rows, ``drafts`` slots per window."""

    def __init__(self, init, coupling, *, batch, drafts, grid, vocab, generator):
        self.init = check_choice("initialisation", init, INIT_STRATEGIES)
        self.coupling = check_choice("coupling", coupling, COUPLINGS)
        self.L, self.V, self.width = drafts, vocab, grid[1]
        self.gen = generator
        dev = generator.device
        if self.coupling == "gumbel":
            # one noise vector per absolute position, fixed for the whole generation (derived from this key,
            # not stored), so the drafts do not depend on the window size or the schedule
            self.noise_key = counter_key(generator)
        if self.init == "sample-above":
            # latest target distribution of each position, kept for one row plus one window
            self.ring = self.width + drafts + 1
            self.history = torch.full((batch, self.ring, vocab), 1.0 / vocab, device=dev)
        self.uniform_q = torch.full((batch, drafts, vocab), 1.0 / vocab, device=dev)

    def record(self, positions: torch.Tensor, p: torch.Tensor) -> None:
        """Remember the target distributions ``p`` [B, W, V] computed for ``positions`` [B, W]."""
        if self.init == "sample-above":
            idx = (positions % self.ring).unsqueeze(-1).expand_as(p)
            self.history.scatter_(1, idx, p)

    def refine(self, p, x, q, positions, noise=None, has_draft=None) -> torch.Tensor:
        """Next drafts of law exactly ``p`` [B, S, V] for slots at ``positions`` [B, S]: the first ``x.shape[1]`` slots
        coupled to the drafts ``x`` (drawn from ``q``; only where ``has_draft``, if given), the rest fresh. ``noise``:
        where random numbers come from (default: the generation's generator; a compiled loop step's draws)."""
        noise = self.gen if noise is None else noise
        if self.coupling == "gumbel":
            return self._gumbel(p, positions)
        fresh = sample(p, noise)
        if self.coupling == "independent":
            return fresh
        drafted = x.shape[1]
        kept = self._kept_or_redrawn(p[:, :drafted], x, q, noise)
        if has_draft is not None:
            kept = torch.where(has_draft, kept, fresh[:, :drafted])
        return torch.cat([kept, fresh[:, drafted:]], dim=1)

    def _gumbel(self, p, positions):
        return (p.log() + counter_gumbel(self.noise_key, positions, self.V)).argmax(-1)

    @staticmethod
    def _kept_or_redrawn(p, x, q, noise):
        """The maximal coupling: keep a draft with probability min(1, p/q), else draw from the residual."""
        keep = uniform(x.shape, noise) < ExactRule().accept_probability(p, q, x)
        return torch.where(keep, x, sample(positive_residual(p, q), noise))

    def initial(self, seq, start, carried, p_last, noise=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts ``[B, L]`` and their q ``[B, L, V]`` for window slots at positions ``start + i``;
        only slots ``i >= carried`` (the fresh ones) are meant to be used. ``seq`` holds the fixed tokens
        and the carried drafts, i.e. every position below ``start + carried``; ``p_last`` is the target
        distribution of the last of them. ``noise``: as ``refine``'s."""
        noise = self.gen if noise is None else noise
        B, L, V = seq.shape[0], self.L, self.V
        known = (start + carried).unsqueeze(1)  # positions below this hold a token (fixed or a carried draft)
        positions = start.unsqueeze(1) + torch.arange(L, device=seq.device)
        left_pos = (known - 1).clamp(min=0).expand(B, L)
        # the token above is known unless the window reaches more than a row ahead: then the left one is used
        above_known = (positions >= self.width) & (positions - self.width < known)
        if self.init == "random":
            x = random_codes(V, (B, L), noise)
            return x, self.uniform_q
        if self.init in ("horizontal", "vertical"):
            source = left_pos
            if self.init == "vertical":
                source = torch.where(above_known, positions - self.width, left_pos)
            x = seq.gather(1, source)
            return x, torch.nn.functional.one_hot(x, V).float()
        dist = p_last.unsqueeze(1).expand(B, L, V)
        if self.init == "sample-above":  # the history holds the latest p of every known position
            above = self.history.gather(1, ((positions - self.width) % self.ring).unsqueeze(-1).expand(B, L, V))
            dist = torch.where(above_known.unsqueeze(-1), above, dist)
        return sample(dist, noise), dist
