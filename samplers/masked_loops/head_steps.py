"""MAR's diffusion head sampling a step's tokens: the reverse process, one reverse step at a time, each step
through torch.compile where the model's compile switch says so (compiled.py's ``compiled_mode``).

Why: a reverse step is the head's whole MLP on a few rows (the tokens a MAR step predicts, twice under CFG), 50
to 100 times per MAR step: eagerly about a hundred small ops each, so on a GPU at the batch sizes of one user
the launches and PyTorch's dispatch, not the arithmetic, are most of a MAR image. Compiled, a step is a few fused
kernels and, on CUDA, one CUDA graph replay.
How: the trajectory noise is drawn before the process starts (masked.Plan), so a step is a pure function of its
inputs; whatever changes between steps or generations (the reverse index's constants, its timestep embedding,
the cfg scale, the temperature) is a tensor input, never a number baked into the graph, and the row count is
dynamic: one graph serves every step's token count (a single row gets a twin, since dynamo specialises a
dimension of 1). Eagerly the same code runs with numbers, exactly as MAR's sampler always did.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ...interrupts import check_interrupt
from ...model_loaders.mar.diffusion import CONSTANTS, ReverseStep, SpacedDiffusion
from ...model_loaders.mar.model import HeadCache
from ...model_loaders.shared.compiled import allow_shapes, compiled_function


@dataclass
class ReverseUpdate:
    """One reverse step's results."""

    x: torch.Tensor  # x_{t-1}: the mean plus this step's noise (unused after the last step)
    mean: torch.Tensor
    std: torch.Tensor  # scaled by the temperature
    path_log_std: torch.Tensor  # the path's log std, this step's included
    mlp: Optional[torch.Tensor] = None  # a recording full call's block MLP outputs [depth, N, width], cond rows
    guidance: Optional[torch.Tensor] = None  # and its guidance gap (cond - uncond eps)


def reverse_update(head, x, condition, time, cfg_scale, c: dict, noise, temperature, path_log_std,
                   kept_mlp=None, kept_gap=None, record: bool = False) -> ReverseUpdate:
    """One reverse step from x_t = ``x``: the head's eps under CFG (``condition``: the embedded conditions, cond then
    uncond rows; ``time``: this step's embedded timestep), the Gaussian of x_{t-1} (``c``: this reverse index's
    constants) and a draw from it along ``noise``. ``kept_mlp``: a reusing call (LazyMAR: the MLP outputs and
    guidance gap an earlier full call recorded); ``record``: a full call that records them."""
    y = condition + time
    mlp = gap = None
    if kept_mlp is None:
        keep = HeadCache() if record else None
        eps, variance = head.guided(x, y, cfg_scale, keep)
        if record:
            mlp, gap = torch.stack(keep.mlp), keep.guidance
    else:
        eps, variance = head.guided_reusing(x, y[: x.shape[0]], cfg_scale, HeadCache(kept_mlp, kept_gap))
    step = SpacedDiffusion.gaussian(x, c, eps, variance)
    std = step.std * temperature
    return ReverseUpdate(step.mean + step.std * noise * temperature, step.mean, std,
                         path_log_std + torch.log(std).sum(-1), mlp, gap)


def compiled_update(head, x, condition, time, cfg_scale, constants, noise, temperature, path_log_std,
                    kept_mlp=None, kept_gap=None, record: bool = False) -> ReverseUpdate:
    """``reverse_update`` with the reverse index's constants as one row of ``SpacedDiffusion.constant_rows``."""
    c = dict(zip(CONSTANTS, constants.unbind()))
    return reverse_update(head, x, condition, time, cfg_scale, c, noise, temperature, path_log_std, kept_mlp,
                          kept_gap, record)


def reverse_process(head, diffusion, z_cond, z_uncond, cfg_scale, temperature: float,
                    start: torch.Tensor, noise: torch.Tensor, head_refresh: int = 0,
                    mode: str | None = None) -> ReverseStep:
    """Run the reverse process from x_T ``start`` [N, C] along ``noise`` for conditions ``[N, D]`` and return
    the last step's Gaussian (its std scaled by the temperature, and the earlier steps' log std summed: relaxed
    CSpD's path factor). The official sampler takes its mean.
    ``cfg_scale``: a float, or ``[N, 1]`` per token. In the head's precision (fp32) throughout.
    ``head_refresh`` > 0: LazyMAR-style reuse, a full head call at the first reverse step and every
    ``head_refresh``-th after it, reusing calls (``DiffusionHead.guided_reusing``) between them.
    ``mode``: the steps through torch.compile in this mode; None: eagerly."""
    dtype = head.input_proj.weight.dtype  # fp32 as loaded (fp64 in the exactness tests)
    x = start.to(dtype)
    z = z_cond if z_uncond is None else torch.cat([z_cond, z_uncond])
    condition = head.cond_embed(z.to(dtype))  # the same at every reverse step: embedded once
    times = head.time_embed(diffusion.model_timesteps(x.device))  # [S, width]: every step's timestep, in one call
    path_log_std = torch.zeros(x.shape[0], dtype=dtype, device=x.device)
    steps = EagerSteps(head, diffusion, cfg_scale, temperature) if mode is None else \
        CompiledSteps(head, diffusion, cfg_scale, temperature, mode, x)
    x, condition, noise, path_log_std = steps.rows_in(x, condition, noise, path_log_std)
    kept_mlp = kept_gap = None
    for index in reversed(range(diffusion.num_steps)):
        check_interrupt()  # Cancel need not wait for the rest of a MAR step's head calls (seconds at large batches)
        full = not head_refresh or (diffusion.num_steps - 1 - index) % head_refresh == 0
        update = steps(x, condition, times[index], index, noise[index], path_log_std,
                       None if full else kept_mlp, None if full else kept_gap, full and head_refresh > 0)
        if index == 0:
            return ReverseStep(*steps.rows_out(update.mean, update.std, path_log_std))
        if update.mlp is not None:
            kept_mlp, kept_gap = update.mlp, update.guidance
        x, path_log_std = update.x, update.path_log_std
    raise AssertionError("a diffusion has at least one step")


class EagerSteps:
    """Reverse steps as MAR's sampler runs them eagerly: the constants and scales as numbers."""

    def __init__(self, head, diffusion: SpacedDiffusion, cfg_scale, temperature: float):
        self.head, self.diffusion, self.cfg_scale, self.temperature = head, diffusion, cfg_scale, temperature

    def rows_in(self, *tensors):
        return tensors

    def rows_out(self, *tensors):
        return tensors

    def __call__(self, x, condition, time, index: int, noise, path_log_std, kept_mlp, kept_gap, record: bool):
        return reverse_update(self.head, x, condition, time, self.cfg_scale, self.diffusion.constants(index), noise,
                              self.temperature, path_log_std, kept_mlp, kept_gap, record)


class CompiledSteps:
    """Reverse steps through one compiled function per mode, every changing number a tensor, the rows dynamic."""

    def __init__(self, head, diffusion: SpacedDiffusion, cfg_scale, temperature: float, mode: str, x: torch.Tensor):
        self.head, self.step = head, compiled_function(compiled_update, mode)
        allow_shapes()  # past dynamo's default of 8 graphs (CFG or not, head reuse, dtypes) it would run eagerly
        self.rows = diffusion.constant_rows(x.device, x.dtype)
        self.twin = x.shape[0] == 1  # a dimension of 1 would be specialised: one row runs as two equal rows
        if not torch.is_tensor(cfg_scale):
            cfg_scale = torch.full((x.shape[0], 1), cfg_scale, dtype=x.dtype, device=x.device)  # a fill, no copy
        self.cfg_scale = self.rows_in(cfg_scale)[0]
        self.temperature = torch.full((), temperature, dtype=x.dtype, device=x.device)

    def rows_in(self, *tensors):
        """The tensors with their rows twinned where there is one (the noise's rows are its second dimension;
        conditions under CFG keep their cond-then-uncond halves, each twinned)."""
        if not self.twin:
            return tensors
        return tuple(t.repeat_interleave(2, dim=1 if t.dim() == 3 else 0) for t in tensors)

    def rows_out(self, *tensors):
        return tensors if not self.twin else tuple(t[:1] for t in tensors)

    def __call__(self, x, condition, time, index: int, noise, path_log_std, kept_mlp, kept_gap, record: bool):
        args = (x, condition, time, self.cfg_scale, self.rows[index], noise.clone(), self.temperature, path_log_std,
                kept_mlp, kept_gap)  # the noise copied: a view's storage offset of 0 (the last step) recompiles
        for tensor, dim in zip(args, (0, 0, None, 0, None, 0, None, 0, 1, 0)):
            if tensor is not None and dim is not None:
                torch._dynamo.mark_dynamic(tensor, dim)
        return self.step(self.head, *args, record)
