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
output is no longer the target's (tests/test_cspd.py measures the bias), so the exact rule leaves it out. All in
log space: at 100 steps the last step's std is about 0.006, where densities overflow.

``Relaxation`` is the reference code's rule (MarkXCloud/CSpD), a relaxed decoder like GSD and LANTERN: the
squared distances in the last step's exponents divided by temperature^2 (42 there; 1 = exact), and optionally its
intermediate factor, prod_t sigma^p_t / sigma^q_t (the paper's, the other way up). Rejected tokens still come
from the exact residual.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...model_loaders.mar.diffusion import ReverseStep


@dataclass(frozen=True)
class Relaxation:
    """The reference code's acceptance (see the module doc); the defaults are the exact rule."""

    temperature: float = 1.0
    path_factor: bool = False

    @property
    def exact(self) -> bool:
        return self.temperature == 1.0 and not self.path_factor


EXACT = Relaxation()


def log_density(x: torch.Tensor, gaussian: ReverseStep, temperature: float = 1.0) -> torch.Tensor:
    """log N(x; mean, std^2) summed over channels, without the constant (it cancels in every ratio), its
    exponent divided by ``temperature``^2 (1: the density itself): [N]."""
    return (-torch.log(gaussian.std) - 0.5 * ((x - gaussian.mean) / (gaussian.std * temperature)) ** 2).sum(-1)


def log_acceptance_ratio(x: torch.Tensor, target: ReverseStep, draft: ReverseStep,
                         relaxation: Relaxation = EXACT) -> torch.Tensor:
    """log p(x) / q(x) of drafted tokens ``x`` [N, C]: [N]; relaxed as ``relaxation`` says."""
    log_ratio = log_density(x, target, relaxation.temperature) - log_density(x, draft, relaxation.temperature)
    if relaxation.path_factor:
        log_ratio = log_ratio + target.path_log_std - draft.path_log_std
    return log_ratio


def accept(x: torch.Tensor, target: ReverseStep, draft: ReverseStep, generator,
           relaxation: Relaxation = EXACT) -> torch.Tensor:
    """[N] bool: U < min(1, p(x) / q(x)) (relaxed as ``relaxation`` says)."""
    u = torch.rand(x.shape[0], generator=generator, device=x.device)
    return torch.log(u) < log_acceptance_ratio(x, target, draft, relaxation)


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
