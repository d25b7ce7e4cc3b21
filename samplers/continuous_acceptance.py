"""The trajectory-ratio rule of continuous speculative decoding: accept a drafted token by the ratio of
the two models' densities, or replace it by a sample of the residual, for diagonal Gaussians.

Both models run the reverse diffusion from the same x_T with the same noise per step (trajectory
alignment); given that shared noise, each model's token is its last reverse step's Gaussian. The
speculative-sampling lemma holds for those Gaussians exactly: accept x ~ q with probability
min(1, p(x) / q(x)), else draw from norm([p - q]_+), and the result is distributed as p. The residual has
no closed form; acceptance-rejection with p as proposal keeps a proposal y with probability
[p(y) - q(y)]_+ / p(y) (the CSpD paper's bound M = 1/Z), which needs no normalising integral.

The paper also multiplies the ratio by prod_t sigma^q_t / sigma^p_t over the intermediate steps. That
factor compares the densities of two different trajectories, not of the drafted token: with it the
output is no longer the target's (tests/test_cspd.py measures the bias), so it is left out. All in log
space: at 100 steps the last step's std is about 0.006, where densities overflow.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model_loaders.mar.diffusion import ReverseStep


def log_density(x: torch.Tensor, gaussian: ReverseStep) -> torch.Tensor:
    """log N(x; mean, std^2) summed over channels, without the constant (it cancels in every ratio): [N]."""
    return (-torch.log(gaussian.std) - 0.5 * ((x - gaussian.mean) / gaussian.std) ** 2).sum(-1)


def log_acceptance_ratio(x: torch.Tensor, target: ReverseStep, draft: ReverseStep) -> torch.Tensor:
    """log p(x) / q(x) of drafted tokens ``x`` [N, C]: [N]."""
    return log_density(x, target) - log_density(x, draft)


def accept(x: torch.Tensor, target: ReverseStep, draft: ReverseStep, generator) -> torch.Tensor:
    """[N] bool: U < min(1, p(x) / q(x))."""
    u = torch.rand(x.shape[0], generator=generator, device=x.device)
    return torch.log(u) < log_acceptance_ratio(x, target, draft)


@dataclass
class Resampled:
    values: torch.Tensor  # [N, C]
    tries: torch.Tensor  # [N] proposals drawn
    fallbacks: int  # tokens that hit the cap and took a plain target sample


def sample_residual(target: ReverseStep, draft: ReverseStep, generator, max_tries: int) -> Resampled:
    """Samples of norm([p - q]_+) by acceptance-rejection with proposal p. A token whose ``max_tries``
    proposals are all refused takes a plain sample of p (the reference code left zeros there)."""
    n, device = target.mean.shape[0], target.mean.device
    values = torch.empty_like(target.mean)
    tries = torch.zeros(n, dtype=torch.long, device=device)
    pending = torch.ones(n, dtype=torch.bool, device=device)
    for _ in range(max_tries):
        if not bool(pending.any()):
            break
        proposal = target.mean + target.std * torch.randn(target.mean.shape, generator=generator, device=device)
        log_keep = torch.log1p(-torch.exp(torch.clamp(log_acceptance_ratio(proposal, draft, target), max=0.0)))
        u = torch.rand(n, generator=generator, device=device)
        kept = pending & (torch.log(u) < log_keep)
        values[kept] = proposal[kept]
        tries += pending.long()
        pending &= ~kept
    fallbacks = int(pending.sum())
    if fallbacks:
        values[pending] = (target.mean + target.std * torch.randn(target.mean.shape, generator=generator,
                                                                  device=device))[pending]
    return Resampled(values, tries, fallbacks)
