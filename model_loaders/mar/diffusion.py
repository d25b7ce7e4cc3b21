"""MAR's token diffusion: the Gaussian diffusion of its DiffLoss head, as the official sampler runs it.

1000 training steps on the cosine schedule (alpha_bar(t) = cos((t + 0.008) / 1.008 * pi / 2)^2, betas capped
at 0.999), respaced to S sampling steps taken evenly from the 1000 (rounding as the official ``space_timesteps``
does), epsilon prediction, and the learned-range variance: the head's second output v in [-1, 1] blends the
clipped posterior log-variance (v = -1) and log beta (v = 1). The schedule is computed in float64 and the
reverse step in float32: keep the head in fp32 (the first reverse step amplifies errors about 300x).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ...errors import FastARError

TRAIN_STEPS = 1000
# one reverse index's constants, in the order of ``constant_rows``
CONSTANTS = ("log_beta", "clipped_log_variance", "recip_sqrt_ac", "recip_sqrt_ac_m1", "coef_x0", "coef_xt")


def cosine_betas(steps: int = TRAIN_STEPS, max_beta: float = 0.999) -> np.ndarray:
    def alpha_bar(t):
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

    return np.array([min(1 - alpha_bar((i + 1) / steps) / alpha_bar(i / steps), max_beta) for i in range(steps)])


def respaced_steps(sampling_steps: int, train_steps: int = TRAIN_STEPS) -> list[int]:
    """The training timesteps kept for ``sampling_steps`` (one section, evenly strided, Python rounding)."""
    if not 1 <= sampling_steps <= train_steps:
        raise FastARError(f"diffusion steps {sampling_steps}: choose between 1 and {train_steps} (MAR uses 100)")
    stride = 1.0 if sampling_steps == 1 else (train_steps - 1) / (sampling_steps - 1)
    kept, position = [], 0.0
    for _ in range(sampling_steps):
        kept.append(round(position))
        position += stride
    return sorted(set(kept))


@dataclass
class ReverseStep:
    """One reverse step's Gaussian: x_{t-1} ~ N(mean, std^2), per token and channel."""

    mean: torch.Tensor
    std: torch.Tensor  # the model's; the official sampler adds no noise at the last step (index 0)
    path_log_std: Optional[torch.Tensor] = None  # [N]: log std summed over the earlier steps and the channels


class SpacedDiffusion:
    """The respaced reverse process. Index i runs from ``num_steps - 1`` (pure noise) down to 0."""

    def __init__(self, sampling_steps: int = 100):
        base = np.cumprod(1.0 - cosine_betas())
        self.timestep_map = respaced_steps(sampling_steps)
        alphas_cumprod = base[self.timestep_map]
        previous = np.append(1.0, alphas_cumprod[:-1])
        betas = 1.0 - alphas_cumprod / previous
        posterior_variance = betas * (1.0 - previous) / (1.0 - alphas_cumprod)
        # the posterior variance is 0 at the first step: its log takes the second step's value
        clipped_log = np.log(np.append(posterior_variance[1], posterior_variance[1:])) if len(betas) > 1 \
            else np.log(np.maximum(posterior_variance, 1e-20))
        table = {
            "log_beta": np.log(betas),
            "clipped_log_variance": clipped_log,
            "recip_sqrt_ac": np.sqrt(1.0 / alphas_cumprod),
            "recip_sqrt_ac_m1": np.sqrt(1.0 / alphas_cumprod - 1.0),
            "coef_x0": betas * np.sqrt(previous) / (1.0 - alphas_cumprod),
            "coef_xt": (1.0 - previous) * np.sqrt(1.0 - betas) / (1.0 - alphas_cumprod),
        }
        self.table = {k: torch.tensor(v, dtype=torch.float32) for k, v in table.items()}
        self.numbers = {k: v.tolist() for k, v in self.table.items()}  # one step's constants, read without tensors
        self.num_steps = len(self.timestep_map)
        self._on_device: dict[str, torch.Tensor] = {}
        self._rows: dict[tuple, torch.Tensor] = {}

    def model_timesteps(self, device) -> torch.Tensor:
        """``[S]``: every reverse index's training timestep, on ``device`` (made once per device: made from
        Python data, it would make a GPU wait at every MAR step)."""
        key = str(device)
        if key not in self._on_device:
            self._on_device[key] = torch.tensor(self.timestep_map, device=device)
        return self._on_device[key]

    def model_timestep(self, index: int) -> int:
        """The training timestep the head is called with at reverse index ``index``."""
        return self.timestep_map[index]

    def constants(self, index: int | torch.Tensor) -> dict:
        """The table at reverse index ``index``: floats, or ``[N, 1]`` columns for a tensor of indices."""
        if isinstance(index, int):
            return {k: v[index] for k, v in self.numbers.items()}
        return {k: v.to(index.device)[index].unsqueeze(-1) for k, v in self.table.items()}

    def constant_rows(self, device, dtype) -> torch.Tensor:
        """``[S, 6]``: each reverse index's constants as a row (in CONSTANTS' order) on ``device`` in ``dtype``, made
        once from the same numbers ``constants`` gives: a compiled reverse step reads its row as an input, where a
        number would be baked into its graph (one graph per reverse index)."""
        key = (str(device), dtype)
        if key not in self._rows:
            self._rows[key] = torch.tensor(list(zip(*(self.numbers[k] for k in CONSTANTS))), dtype=dtype, device=device)
        return self._rows[key]

    def reverse_step(self, x: torch.Tensor, index: int | torch.Tensor, eps: torch.Tensor,
                     variance_values: torch.Tensor) -> ReverseStep:
        """The Gaussian of x_{t-1} given x_t = ``x`` and the head's outputs at reverse index ``index``."""
        return self.gaussian(x, self.constants(index), eps, variance_values)

    @staticmethod
    def gaussian(x: torch.Tensor, c: dict, eps: torch.Tensor, variance_values: torch.Tensor) -> ReverseStep:
        """The Gaussian of x_{t-1} given x_t = ``x``, the head's outputs and one reverse index's constants ``c``
        (numbers, columns, or 0-d tensors)."""
        x0 = c["recip_sqrt_ac"] * x - c["recip_sqrt_ac_m1"] * eps
        blend = (variance_values + 1) / 2
        log_variance = blend * c["log_beta"] + (1 - blend) * c["clipped_log_variance"]
        return ReverseStep(SpacedDiffusion.posterior_mean(x0, x, c), torch.exp(0.5 * log_variance))

    @staticmethod
    def posterior_mean(x0: torch.Tensor, x: torch.Tensor, c: dict) -> torch.Tensor:
        """The mean of q(x_{t-1} | x_t = x, x_0)."""
        return c["coef_x0"] * x0 + c["coef_xt"] * x

    def noised(self, x0: torch.Tensor, index: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """x_t ~ q(x_t | x_0) at reverse indices ``index`` [N] (training)."""
        c = self.constants(index)
        return (x0 + c["recip_sqrt_ac_m1"] * noise) / c["recip_sqrt_ac"]
