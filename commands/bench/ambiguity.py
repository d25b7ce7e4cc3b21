"""How ambiguous a model's next token is: LANTERN's "token selection ambiguity" (its Fig. 2), the reason exact
drafting barely pays on real image models and relaxed acceptance does.

Measured along samples (the model's own, from plain AR): the distribution the decoders sample from at every image
position (CFG, temperature, top-k and top-p applied), its top-1 probability and entropy, averaged over positions
and samples. One teacher-forced forward per chunk: the session takes the sample's tokens as one window.
"""
from __future__ import annotations

import torch

from ...samplers.processing import SamplingSettings, probabilities


@torch.no_grad()
def next_token_ambiguity(model, conditioning, sampling: SamplingSettings, codes: torch.Tensor) -> dict[str, list]:
    """Per sample of ``codes`` [B, N] (drawn under ``conditioning``): the mean top-1 probability and the mean
    entropy (nats) of the sampling distribution at each of its N positions."""
    B, N = codes.shape
    session = model.start(conditioning, cfg=sampling.use_cfg, max_window=N - 1)
    first = probabilities(session.first, sampling)
    start = torch.zeros(B, dtype=torch.long, device=model.device)
    rest = probabilities(session.forward(codes[:, :-1].to(model.device), start), sampling)
    p = torch.cat([first, rest], dim=1).float()  # position j's distribution, [B, N, V]
    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)
    return {"top1_probability": p.amax(-1).mean(1).tolist(), "entropy_nats": entropy.mean(1).tolist()}


def first_draft_acceptance(accepted: list[int]) -> float:
    """The share of iterations that kept their first draft: an iteration fixes its accepted drafts plus one token
    of the target's, so a run of one means the first draft was rejected (an image's last token, which leaves
    nothing to draft, counts as one: a bias of one iteration per image)."""
    return sum(1 for c in accepted if c > 1) / max(len(accepted), 1)
