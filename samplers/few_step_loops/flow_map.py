"""The flow-matching map of Distilled Decoding (decoders.md, "DD"): one token's Gaussian noise -> one code,
deterministically, with the code distributed exactly as the next-token distribution ``p``.

The target is a mixture of Dirac masses at the code vectors ``c_j`` (as the image decoder sees them) with
weights ``p_j``; the path is ``x_t = (1 - t) eps + t c``. Given ``x_t``, the posterior over codes is
``w_j ∝ p_j exp(-||x - t c_j||^2 / (2 (1 - t)^2))`` and the marginal velocity is
``v = (D(x, t) - x) / (1 - t)`` with ``D = sum_j w_j c_j`` (the expected clean code). The ODE moves
probability mass without mixing it, so the Gaussian measure of the noises that end at ``c_j`` is ``p_j``.
(The seed's eq. (3) has ``+`` in the exponent: that velocity sends mass to the wrong codes.)

The solver works on ``D`` in log-SNR time ``lambda = log(t / (1 - t))`` (DPM-Solver++(2M) for the
rectified-flow schedule alpha_t = t, sigma_t = 1 - t): the first step from pure noise is exact for a
constant ``D``, the last one lands on ``D`` itself at t = 1, and the end point snaps to the nearest code.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...errors import FastARError


@dataclass(frozen=True)
class FlowMapSettings:
    steps: int = 16  # solver steps = evaluations of the posterior (the paper: 10; 16 reaches the sampling noise)
    t_first: float = 0.05  # the first step goes from pure noise to this t
    t_last: float = 0.99  # the last step goes from this t to the code
    order: int = 3  # multistep order (1 = DDIM)

    def validate(self) -> "FlowMapSettings":
        if not 2 <= self.steps <= 1000:
            raise FastARError(f"flow-map steps {self.steps} is out of range: use 2..1000 (default 10)")
        if not 0.0 < self.t_first < self.t_last < 1.0:
            raise FastARError(f"flow-map times must satisfy 0 < t_first < t_last < 1 (got {self.t_first}, "
                              f"{self.t_last})")
        return self


def time_grid(settings: FlowMapSettings) -> list[float]:
    """``0, t_first, ..., t_last, 1``: log-SNR-uniform in between, ``settings.steps`` steps in all."""
    lo, hi = (math.log(t / (1 - t)) for t in (settings.t_first, settings.t_last))
    inner = settings.steps - 1
    lambdas = [lo + (hi - lo) * i / (inner - 1) for i in range(inner)] if inner > 1 else [lo]
    return [0.0] + [1 / (1 + math.exp(-lam)) for lam in lambdas] + [1.0]


def expected_code(x: torch.Tensor, t: float, log_p: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """``D(x, t) = E[c | x_t = x]``: ``x`` [R, C], ``log_p`` [R, V], ``codebook`` [V, C] -> [R, C]."""
    if t == 0.0:
        return log_p.softmax(-1) @ codebook
    sq_dist = torch.cdist(x, t * codebook).square()
    return (log_p - sq_dist / (2 * (1 - t) ** 2)).softmax(-1) @ codebook


def nearest_code(x: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Index of the nearest code vector of each row of ``x`` [R, C] (lowest index on ties)."""
    return torch.cdist(x, codebook).argmin(-1)


def flow_map(probs: torch.Tensor, noise: torch.Tensor, codebook: torch.Tensor,
             settings: FlowMapSettings = FlowMapSettings()) -> torch.Tensor:
    """Codes ``[...]`` for next-token distributions ``probs`` [..., V] and noises ``noise`` [..., C]."""
    if codebook.shape[0] != probs.shape[-1] or codebook.shape[1] != noise.shape[-1]:
        raise FastARError(f"the codebook is {tuple(codebook.shape)} but the model predicts {probs.shape[-1]} codes "
                          f"from {noise.shape[-1]}-channel noise: use the image decoder this model was trained with")
    shape = probs.shape[:-1]
    codebook = codebook.double()
    log_p = probs.reshape(-1, probs.shape[-1]).double().log()
    x = noise.reshape(-1, noise.shape[-1]).double()
    times = time_grid(settings)
    history: list[tuple[torch.Tensor, float]] = []  # (D, lambda) at the finite-lambda points so far
    for s, t in zip(times[:-1], times[1:]):
        d = expected_code(x, s, log_p, codebook)
        if t == 1.0:
            x = d
            break
        lam_t = math.log(t / (1 - t))
        if s == 0.0:  # from pure noise (lambda = -inf): exact for a constant D
            x = (1 - t) * x + t * d
            continue
        history = (history + [(d, math.log(s / (1 - s)))])[-settings.order:]
        x = (1 - t) / (1 - s) * x + t * multistep_increment(history, lam_t)
    return nearest_code(x, codebook).view(shape)


def multistep_increment(history: list[tuple[torch.Tensor, float]], lam_t: float) -> torch.Tensor:
    """``alpha_t``-free part of DPM-Solver++'s multistep update from the last point of ``history`` to
    ``lam_t`` (order = the number of points given, at most 3)."""
    d0, lam0 = history[-1]
    h = lam_t - lam0
    phi1 = -math.expm1(-h)  # 1 - e^-h
    if len(history) == 1:
        return phi1 * d0
    d1, lam1 = history[-2]
    r0 = (lam0 - lam1) / h
    slope0 = (d0 - d1) / r0
    if len(history) == 2:
        return phi1 * (d0 + slope0 / 2)
    d2, lam2 = history[-3]
    r1 = (lam1 - lam2) / h
    slope1 = (d1 - d2) / r1
    first = slope0 + r0 / (r0 + r1) * (slope0 - slope1)
    second = (slope0 - slope1) / (r0 + r1)
    phi2 = 1 - phi1 / h  # (e^-h - 1) / h + 1
    phi3 = phi2 / h - 0.5
    return phi1 * d0 + phi2 * first - phi3 * second


def token_noise(batch: int, num_tokens: int, channels: int, generator: torch.Generator) -> torch.Tensor:
    """One Gaussian noise vector per image token, ``[B, N, C]`` in raster order (channel-last)."""
    return torch.randn(batch, num_tokens, channels, generator=generator, device=generator.device)


class NoiseToCode:
    """Draws token i of every row from its own noise ``noise[:, i]`` through the flow map: a draw
    function for plain AR that makes the image a deterministic function of the noise."""

    def __init__(self, noise: torch.Tensor, codebook: torch.Tensor, settings: FlowMapSettings = FlowMapSettings()):
        self.noise, self.codebook, self.settings = noise, codebook, settings.validate()

    def __call__(self, dist: torch.Tensor, position: int) -> torch.Tensor:
        return flow_map(dist, self.noise[:, position], self.codebook, self.settings)

    def span(self, dists: torch.Tensor, begin: int, end: int) -> torch.Tensor:
        """Tokens ``begin..end`` at once (a VAR scale, drawn in parallel): ``dists`` [B, end - begin, V]."""
        return flow_map(dists, self.noise[:, begin:end], self.codebook, self.settings)
