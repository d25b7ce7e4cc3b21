"""Infinity-2B's shape at 1024 px (1:1: 13 scales to 64 x 64) with random weights, one image (batch 1, guidance on):
the plain sampler against FastVAR's and SkipVAR's settings.

    python -m fastar.commands.profile.infinity [--layers 2] [--device cpu] [--out profile.json]

- the share of the transformer's FLOPs each setting runs: its tokens and keys counted in a run at the 2B's full depth
  (32 blocks, so that FastVAR's blocks 3..27 prune) on a narrow copy (the counts do not depend on the width), the
  FLOPs estimated at the 2B's width (2048, FFN 8192; samplers/few_step_loops/scale_acceleration.py);
- the time of each scale's forward on a copy of the 2B's shape cut to ``--layers`` blocks (the depth scales every
  scale's time alike; FastVAR prunes the same share of blocks, rounded: at 2 blocks both, where the 2B prunes 25 of
  32, so a pruned scale's time there is a pruned block's, and the FLOP share is the whole model's). Random weights
  sample random bits, which costs the same as real ones; on a CPU shared with other work the times are rough.
"""
from __future__ import annotations

import argparse
import json
import types

import torch

from ...model_loaders.infinity.model import Infinity, InfinityConfig
from ...model_loaders.infinity.schedules import scale_schedule
from ...model_loaders.infinity.vae import InfinityVAE, InfinityVAEConfig
from ...model_loaders.shared.protocol import CaptionConditioning
from ...pipeline import resolve_device
from ...samplers.decoders import decode_next_scale
from ...samplers.few_step_loops import next_scale, scale_acceleration
from ...samplers.processing import SamplingSettings
from .var import SETTINGS, timed_scales

SIZE, PROMPT_TOKENS = 1024, 32
SAMPLING = SamplingSettings(cfg_scale=3.0, temperature=0.5, top_k=900, top_p=0.97)  # the release's 2B defaults


def build_infinity(depth: int, dim: int, ffn: int, heads: int, device, dtype) -> tuple[Infinity, InfinityVAE]:
    scales, rope_grid = scale_schedule(SIZE, "1:1")
    torch.manual_seed(0)
    cfg = InfinityConfig(depth=depth, dim=dim, n_head=heads, ffn_hidden=ffn, scales=scales, rope_grid=rope_grid)
    model = Infinity(cfg).to(device, dtype).eval().requires_grad_(False)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    # only next_input runs while sampling (no weights): the smallest VAE does
    vae = InfinityVAE(InfinityVAEConfig(codebook_dim=32, ch=32, ch_mult=(1,) * 5, num_res_blocks=0)).to(device)
    return model, vae.eval()


def caption(device) -> CaptionConditioning:
    features = torch.randn(1, PROMPT_TOKENS, 2048, generator=torch.Generator().manual_seed(0))
    return CaptionConditioning(features.to(device), torch.ones(1, PROMPT_TOKENS, dtype=torch.bool, device=device))


def flops_shares(device) -> dict:
    """Each setting's share of the plain sampler's transformer FLOPs at the 2B's size."""
    model, vae = build_infinity(32, 64, 256, 2, device, torch.float32)
    big = types.SimpleNamespace(depth=32, dim=2048, ffn_hidden=8192)
    shares, original = {"ar": 1.0}, next_scale.accelerated
    for label, acceleration in SETTINGS.items():
        if acceleration is None:
            continue
        runs = []
        next_scale.accelerated = lambda *a: runs.append(original(*a)) or runs[-1]
        try:
            decode_next_scale(model, caption(device), SAMPLING, seed=0, vqvae=vae, acceleration=acceleration)
        finally:
            next_scale.accelerated = original
        stats = types.SimpleNamespace(settings={})
        scale_acceleration.report(stats, acceleration, runs[0].pruning, rows=2, depth=big.depth, dim=big.dim,
                                  hidden=big.ffn_hidden)
        shares[label] = stats.transformer_work
    return shares


def run_infinity_profile(layers: int, device, dtype) -> dict:
    report = {"shape": f"infinity-2b at {SIZE} px, 1:1, {layers} of 32 blocks for the times", "device": str(device),
              "dtype": str(dtype).replace("torch.", ""), "flops_share": flops_shares(device), "settings": {}}
    model, vae = build_infinity(layers, 2048, 8192, 16, device, dtype)
    times = timed_scales(model)
    report["scales"] = [list(s) for s in model.scale_shapes]
    print(f"[profile] Infinity-2B's shape, {layers} blocks, {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M "
          f"parameters on {device}, batch 1 with guidance, {SIZE} px")
    for label, acceleration in SETTINGS.items():
        decode_next_scale(model, caption(device), SAMPLING, seed=0, vqvae=vae, acceleration=acceleration)
        per_scale = times[-1]
        report["settings"][label] = {"scale_s": per_scale, "total_s": sum(per_scale)}
    plain = report["settings"]["ar"]["total_s"]
    for label, r in report["settings"].items():
        r["speed_up"] = plain / r["total_s"]
        print(f"[profile] {label}: {r['total_s']:.2f} s ({r['speed_up']:.2f}x), "
              f"{100 * report['flops_share'][label]:.1f}% of the 2B's transformer FLOPs; per scale "
              f"{' '.join(f'{t * 1000:.0f}' for t in r['scale_s'])} ms")
    return report


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2, help="blocks of the timed copy (the 2B has 32)")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when there is one)")
    parser.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default="fp32")
    parser.add_argument("--out", help="write the report as JSON")
    args = parser.parse_args(argv)
    device = resolve_device(args.device or "auto")
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    report = run_infinity_profile(args.layers, device, dtype)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
