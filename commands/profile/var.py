"""``python -m fastar profile --shape var-d16`` (or var-d20, var-d24, var-d30): the released VAR shapes at 256 px with
random weights, one image per setting (batch 1, guidance on): the plain sampler against FastVAR's and SkipVAR's
settings, the time of each scale's forward, and the whole image's speed-up. Random weights sample random codes,
which costs the same as real ones; on a CPU shared with other work the times are rough."""
from __future__ import annotations

import time

import torch

from ...model_loaders.shared.protocol import ClassConditioning
from ...model_loaders.var.model import VAR, VARConfig
from ...model_loaders.var.vqvae import MultiScaleVQVAE, VQVAEConfig
from ...samplers.decoders import decode_next_scale
from ...samplers.few_step_loops.next_scale import VAR_SAMPLING
from ...samplers.few_step_loops.scale_acceleration import FASTVAR, ScaleAcceleration
from ...pipeline import resolve_device

VAR_SHAPES = {f"var-d{depth}": depth for depth in (16, 20, 24, 30)}  # the release: width 64 x depth, 16 heads per 1024
SETTINGS = {"ar": None, "fastvar": FASTVAR, "fastvar-prune": ScaleAcceleration(prune_ratios=FASTVAR.prune_ratios),
            "skip-2": ScaleAcceleration(skip_last=2), "uncond-2": ScaleAcceleration(uncond_last=2)}


def build_var(depth: int, device, dtype) -> tuple[VAR, MultiScaleVQVAE]:
    torch.manual_seed(0)
    model = VAR(VARConfig(depth=depth, dim=64 * depth, n_head=depth)).to(device, dtype).eval()
    # only the quantiser's Phi convs run while sampling: the smallest encoder and decoder do
    vqvae = MultiScaleVQVAE(VQVAEConfig(ch=32, ch_mult=(1, 1), num_res_blocks=0)).to(device).eval()
    return model, vqvae


def timed_scales(model) -> list:
    """Wraps ``model.start`` so each scale's forward (plain or pruned) appends its seconds to the returned list."""
    times, start = [], model.start

    def timing(method):
        def run(*args, **kwargs):
            began = time.perf_counter()
            out = method(*args, **kwargs)
            if out.cond.is_cuda:
                torch.cuda.synchronize()
            times[-1].append(time.perf_counter() - began)
            return out
        return run

    def started(*args, **kwargs):
        session = start(*args, **kwargs)
        times.append([])
        session.forward, session.forward_pruned = timing(session.forward), timing(session.forward_pruned)
        return session

    model.start = started
    return times


def run_var_profile(args) -> dict:
    device = resolve_device(args.device or "auto")
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype or "fp32"]
    model, vqvae = build_var(VAR_SHAPES[args.shape], device, dtype)
    times = timed_scales(model)
    rows = ClassConditioning(torch.tensor([1]))
    report = {"shape": args.shape, "device": str(device), "dtype": args.dtype or "fp32",
              "params": sum(p.numel() for p in model.parameters()), "patch_nums": list(model.cfg.patch_nums),
              "settings": {}}
    print(f"[profile] {args.shape}: {report['params'] / 1e6:.0f}M parameters on {device}, batch 1 with guidance")
    decode_next_scale(model, rows, VAR_SAMPLING, seed=0, vqvae=vqvae)  # warm-up
    for label, acceleration in SETTINGS.items():
        _, stats = decode_next_scale(model, rows, VAR_SAMPLING, seed=0, vqvae=vqvae, acceleration=acceleration)
        per_scale = times[-1]
        report["settings"][label] = {"scale_s": per_scale, "total_s": sum(per_scale),
                                     "flops_share": 1.0 if stats.transformer_work is None else stats.transformer_work}
    plain = report["settings"]["ar"]["total_s"]
    for label, r in report["settings"].items():
        r["speed_up"] = plain / r["total_s"]
        print(f"[profile] {label}: {r['total_s']:.2f} s ({r['speed_up']:.2f}x), {100 * r['flops_share']:.0f}% of the "
              f"FLOPs; per scale {' '.join(f'{t * 1000:.0f}' for t in r['scale_s'])} ms")
    return report
