"""VAR's sampler (``--decoder ar`` on a next-scale model): one forward per scale, every token of a scale drawn
in parallel given the earlier scales.

Guidance ramps over the scales as in the release: at scale k of S, ``t = cfg * k / (S - 1)`` and the logits
are ``(1 + t) cond - t uncond``, i.e. the shared pipeline's guidance scale ``1 + t`` (``cfg`` 0 turns guidance
off; the release evaluates at 1.5). Temperature, top-k and top-p then go through the same processing as every
other decoder. Each scale's codes are added to the VQVAE's running f_hat, whose area-downsampled copy is the
next scale's input; the result is f_hat, the VQVAE decoder's input.

Infinity runs in the same loop: its scales are (h, w) grids (``model.scale_shapes``), each token carries
``model.codes_per_slot`` bits, each a two-way choice through the same processing, its guidance is constant over the
scales (``model.guidance``, 1 = off), and the model itself places its bits in its BSQ VAE (``model.next_input``).
"""
from __future__ import annotations

from dataclasses import asdict, replace
from typing import Callable, Optional

import torch

from ...errors import FastARError
from ..processing import SamplingSettings, probabilities, sample
from ..stats import DecodeStats, Stopwatch
from ..token_loops.verifier import ProgressFn
from .scale_acceleration import ScaleAcceleration, accelerated


VAR_SAMPLING = SamplingSettings(cfg_scale=1.5, top_k=900, top_p=0.96)  # the release's FID setting


def scale_sampling(sampling: SamplingSettings, scale: int, scales: int) -> SamplingSettings:
    """The pipeline's settings at one scale: guidance ``1 + cfg * scale / (scales - 1)``."""
    return replace(sampling, cfg_scale=1.0 + sampling.cfg_scale * scale / max(scales - 1, 1))


def scale_shapes(model) -> list[tuple[int, int]]:
    """Each scale's (h, w) tokens: the model's own (Infinity's), else VAR's ``pn x pn``."""
    shapes = getattr(model, "scale_shapes", None)
    return [tuple(s) for s in shapes] if shapes is not None else [(p, p) for p in model.cfg.patch_nums]


def scale_layout(model, shapes) -> dict:
    """The scales as the statistics name them: VAR's patch_nums, or each (h, w)."""
    if hasattr(model, "scale_shapes"):
        return {"scales": [list(s) for s in shapes]}
    return {"patch_nums": list(model.cfg.patch_nums)}


def constant_guidance(model) -> bool:
    return getattr(model, "guidance", "ramp") == "constant"


def image_steps(model, vqvae):
    """(f_hat's shape, ``next_input(f_hat, codes, scale)``): the model's own where it places its codes itself
    (Infinity's bits), else VAR's VQVAE, checked against the model."""
    if hasattr(model, "next_input"):
        model.check_image_decoder(vqvae)
        return model.f_hat_shape, lambda f_hat, codes, scale: model.next_input(vqvae, f_hat, codes, scale)
    if vqvae.cfg.codebook_size != model.vocab_size or vqvae.cfg.z_channels != model.cfg.channels:
        raise FastARError(f"the VQVAE has {vqvae.cfg.codebook_size} codes of width {vqvae.cfg.z_channels} but the VAR "
                          f"model predicts {model.vocab_size} of width {model.cfg.channels}: load the VQVAE it was "
                          "trained with")
    patch_nums = model.cfg.patch_nums
    return ((model.cfg.channels, *model.grid),
            lambda f_hat, codes, scale: vqvae.next_input(f_hat, codes.to(vqvae.device), scale, patch_nums))


ScaleDrawFn = Callable[[torch.Tensor, int, int], torch.Tensor]  # (dists [B, n, V], begin, end) -> codes [B, n]


class RecordedDraw:
    """A draw function that keeps what it drew: ``codes`` is every scale's codes joined, ``[B, L]``."""

    def __init__(self, draw: ScaleDrawFn):
        self.draw, self.parts = draw, []

    def __call__(self, dists: torch.Tensor, begin: int, end: int) -> torch.Tensor:
        self.parts.append(self.draw(dists, begin, end))
        return self.parts[-1]

    @property
    def codes(self) -> torch.Tensor:
        return torch.cat(self.parts, dim=1)


@torch.no_grad()
def next_scale_decode(model, vqvae, conditioning, sampling: SamplingSettings, *, generator: Optional[torch.Generator],
                      on_iteration: Optional[ProgressFn] = None, watch: Optional[Stopwatch] = None,
                      draw: Optional[ScaleDrawFn] = None, name: str = "ar", scale_codes: Optional[list] = None,
                      acceleration: Optional[ScaleAcceleration] = None):
    """f_hat ``[B, C, h, w]`` (the VQVAE decoder's input) and its DecodeStats (one forward per scale). ``draw``
    picks a scale's codes (tokens ``begin..end`` of the sequence) from their distributions; by default a seeded
    sample (``fm``: the flow map of each token's own noise). ``scale_codes``, a list, receives each scale's codes
    ``[B, h, w]`` in order (Infinity's bits ``[B, h, w, bits]``). ``acceleration``: FastVAR / SkipVAR
    (scale_acceleration.py)."""
    draw = draw or (lambda dists, _begin, _end: sample(dists, generator))
    watch = watch or Stopwatch(model.device)
    shapes, constant = scale_shapes(model), constant_guidance(model)
    f_hat_shape, next_input = image_steps(model, vqvae)
    B, S, total = conditioning.batch, len(shapes), model.cfg.seq_len
    guided = sampling.use_cfg if constant else sampling.cfg_scale != 0.0
    session = model.start(conditioning, cfg=guided)
    faster = accelerated(acceleration, model, session, B * (2 if guided else 1))
    f_hat = torch.zeros(B, *f_hat_shape, device=model.device)
    per_slot = getattr(model, "codes_per_slot", 1)
    inputs, done = None, 0
    stats = DecodeStats(decoder=name, grid=tuple(model.grid), batch=B, tokens=total, baseline_forwards=S,
                        baseline="VAR's sampler (one forward per scale)",
                        settings={"model_kind": model.kind, **scale_layout(model, shapes), **asdict(sampling)})
    for scale, (h, w) in enumerate(shapes[: faster.runs if faster else S]):
        out = faster.forward(scale, inputs) if faster else session.forward(scale, inputs)
        dists = probabilities(out, sampling if constant else scale_sampling(sampling, scale, S))
        codes = draw(dists, done, done + h * w).view(B, h, w, per_slot)
        codes = codes if per_slot > 1 else codes[..., 0]
        if scale_codes is not None:
            scale_codes.append(codes)
        f_hat, inputs = next_input(f_hat, codes, scale)
        stats.target_forwards += 1
        stats.fixed_per_forward.append([h * w] * B)
        done += h * w
        watch.lap("forward")
        if on_iteration is not None:
            on_iteration(done, total, f_hat)
    stats.fixed_at = [[scale + 1 for scale, (h, w) in enumerate(shapes) for _ in range(h * w)]] * B
    if faster:
        faster.report(stats)
    stats.wall_time_s, stats.forward_time_s = watch.elapsed(), watch.totals.get("forward", 0.0)
    return f_hat, stats
