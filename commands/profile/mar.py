"""``python -m fastar profile`` for MAR (``--shape mar-b|mar-l|mar-h``, or ``--model`` a MAR checkpoint).

A MAR step has no KV cache: the transformer runs over the class buffer and every token each step (the known
ones through the encoder, all of them through the decoder), then the diffusion head runs its reverse process
for the tokens the step predicts. Per batch (each image with its CFG row) the report gives:
- ``forward_ms``: one transformer call at mid-schedule (half the tokens known), its floor (every weight read
  once over the measured bandwidth) and its arithmetic (GFLOP per call): a MAR call is compute bound;
- ``head_step_ms``: one reverse step of the head for one MAR step's tokens (guided: cond and uncond in one
  call), and ``head_ms`` for the whole reverse process (``diffusion_steps`` of them);
- ``reuse``: what LazyMAR-style feature reuse (its default settings) makes of the same call and reverse step:
  a reusing transformer call (the guided rows, one step's fresh tokens, the default share of the other slots
  after the pruning block) and a reusing head step (the guided rows, the kept MLP outputs), with their speed-ups
  and the whole MAR step's at the default schedule (how many calls reuse, one head call in ``head_refresh_every``
  in full);
- ``head_process_ms``: the whole reverse process of one MAR step's tokens as the sampler runs it (every reverse
  step: the head, the Gaussian, the draw), eagerly; with ``--compile`` also through compiled reverse steps
  (``compiled_head``: its time, the speed-up, and how far apart the two processes' tokens are);
- whole images of ``ar`` (MAR's sampler) and ``cspd`` (drafted by a smaller MAR: the paper's MAR-B for MAR-L
  and MAR-H, a 2 + 2-block model of the shape otherwise, or ``--drafter`` with ``--model``), ms per target call;
  with ``--compile`` their steps run compiled (``compiled_forward_ms``: the transformer call so), and ``ar (eager)`` is
  timed beside them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ...errors import FastARError
from ...model_loaders.mar.model import MAR, MARConfig
from ...model_loaders.shared.protocol import ClassConditioning
from ...model_loaders.mar.lazy import LazyFeatures
from ...model_loaders.mar.model import HeadCache
from ...samplers.decoders import decode_masked
from ...model_loaders.shared.compiled import compile_steps, compiled_mode
from ...samplers.masked_loops.feature_reuse import FeatureReuse
from ...samplers.masked_loops.head_steps import reverse_process
from ...samplers.masked_loops.masked import MaskedSettings, compiled_conditions
from .common import Timing, image_costs, randomise

MAR_DECODERS = ("ar", "cspd")
DRAFT_BLOCKS = 2  # a shape without a smaller release drafts with itself cut to this many encoder/decoder blocks


@dataclass(frozen=True)
class MARShape:
    width: int
    depth: int  # encoder blocks = decoder blocks
    heads: int
    head_width: int  # the diffusion head (diffloss_w)
    head_depth: int  # diffloss_d
    draft: str | None = None  # the released smaller MAR that drafts for it
    grid: tuple[int, int] = (16, 16)  # 256 px through the KL-16 autoencoder
    buffer: int = 64  # class-embedding slots

    def build(self, depth: int | None = None) -> MAR:
        depth = depth or self.depth
        return MAR(MARConfig(dim=self.width, encoder_depth=depth, encoder_heads=self.heads, decoder_dim=self.width,
                             decoder_depth=depth, decoder_heads=self.heads, head_width=self.head_width,
                             head_depth=self.head_depth, grid=self.grid, buffer=self.buffer))


MAR_SHAPES = {
    "mar-tiny": MARShape(64, 2, 4, 64, 2, grid=(4, 4), buffer=4),  # for a quick smoke run
    "mar-b": MARShape(768, 12, 12, 1024, 6),
    "mar-l": MARShape(1024, 16, 16, 1280, 8, draft="mar-b"),
    "mar-h": MARShape(1280, 20, 16, 1536, 12, draft="mar-b"),
}


def build_mar(shape: str, device, dtype, *, depth: int | None = None, seed: int = 0) -> MAR:
    with torch.device(device):
        model = MAR_SHAPES[shape].build(depth)
    randomise(model, seed)
    model.to(dtype).diffloss.float()  # the head stays fp32, as the loader keeps it
    return model.eval()


def random_draft(shape: str, device, dtype) -> MAR:
    spec = MAR_SHAPES[shape]
    if spec.draft:
        return build_mar(spec.draft, device, dtype, seed=1)
    return build_mar(shape, device, dtype, depth=DRAFT_BLOCKS, seed=1)


def transformer_gflop(model: MAR, rows: int, known: int, attention: bool = True) -> float:
    """Multiply-adds x 2 of one call: the token projection, the encoder over buffer + known tokens, the
    projection to the decoder, the decoder over buffer + all tokens (``attention``: with its two products)."""
    cfg, L = model.cfg, model.cfg.num_tokens

    def blocks(depth, width, tokens):  # qkv, proj and the two MLP matmuls; attention's two products
        return depth * (2 * tokens * width * width * (4 + 2 * cfg.mlp_ratio) + attention * 4 * tokens * tokens * width)
    encoder = 2 * L * cfg.token_dim * cfg.dim + blocks(cfg.encoder_depth, cfg.dim, cfg.buffer + known)
    decoder = 2 * (cfg.buffer + known) * cfg.dim * cfg.decoder_dim + \
        blocks(cfg.decoder_depth, cfg.decoder_dim, cfg.buffer + L)
    return rows * (encoder + decoder) / 1e9


@torch.no_grad()
def mar_batch(model: MAR, draft, timing: Timing, batch: int, bytes_per_s: float, decoders: bool,
              rounds: int) -> dict:
    """The measurements of one batch size (see the module doc)."""
    cfg, L = model.cfg, model.cfg.num_tokens
    settings = MaskedSettings(num_iter=min(64, L), cfg_scale=3.0)
    rows = 2 * batch
    labels = torch.zeros(rows, dtype=torch.long, device=model.device)
    tokens = torch.randn(rows, L, cfg.token_dim, device=model.device)
    known = torch.zeros(rows, L, dtype=torch.bool, device=model.device)
    known[:, : L // 2] = True
    vectors = model.class_emb(labels)
    forward_s = timing.median_s(lambda: model.conditions(tokens, known, vectors, L // 2))  # as the sampler calls it
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    floor_ms = weights / bytes_per_s * 1e3
    per_step = -(-L // settings.num_iter) * batch  # tokens one MAR step predicts (the head's rows, per branch)
    head = model.head
    x = torch.randn(per_step, cfg.token_dim, device=model.device)
    z = torch.randn(per_step, cfg.decoder_dim, device=model.device)
    y = head.cond_embed(torch.cat([z, z])) + head.time_embed(torch.tensor([500], device=model.device))
    head_step_s = timing.median_s(lambda: head.guided(x, y, settings.cfg_scale))  # as a reverse step calls it
    entry = {"floor_ms": floor_ms, "forward_ms": forward_s * 1e3, "forward_over_floor": forward_s * 1e3 / floor_ms,
             "forward_gflop": transformer_gflop(model, rows, L // 2), "head_step_ms": head_step_s * 1e3,
             "head_ms": head_step_s * 1e3 * settings.diffusion_steps, "mar_steps": settings.num_iter,
             "reuse": reuse_costs(model, timing, batch, settings, tokens, known, vectors, (x, y, head_step_s),
                                  forward_s)}
    mode = compiled_mode(model)
    entry |= head_process_costs(model, timing, settings, x, z, mode)
    if mode:
        call = functools.partial(compiled_conditions(type(model), mode), model)
        for count in (L // 2 - 1, L // 2):  # the first two counts compile (the second: every later count)
            call(tokens, known, vectors, count)
        entry["compiled_forward_ms"] = timing.median_s(lambda: call(tokens, known, vectors, L // 2)) * 1e3
    if decoders:
        conditioning = ClassConditioning(torch.zeros(batch, dtype=torch.long))

        def run(name):
            decoder, switch = name.split(" ")[0], "on" if mode and "eager" not in name else "off"

            def image(seed):
                compile_steps(model, switch, mode)
                tokens, stats = decode_masked(model, conditioning, settings, decoder, seed=seed,
                                              drafter=draft if decoder == "cspd" else None)
                return stats.target_forwards, tokens
            return image
        names = [name for name in MAR_DECODERS if name == "ar" or draft is not None] + (["ar (eager)"] if mode else [])
        costs, _ = image_costs({name: run(name) for name in names}, timing, rounds)
        compile_steps(model, "on" if mode else "off", mode)
        for cost in costs.values():
            cost["over_floor"] = cost["ms_per_iteration"] / floor_ms
        entry["decoders"] = costs
    return entry


def head_process_costs(model: MAR, timing: Timing, settings: MaskedSettings, x: torch.Tensor, z: torch.Tensor,
                       mode: str | None) -> dict:
    """One MAR step's reverse process (``x``: its tokens' x_T, ``z``: their conditions, guided) eagerly and, with a
    compile ``mode``, through compiled steps (the module doc)."""
    diffusion = model.diffusion(settings.diffusion_steps)
    noise = torch.randn(diffusion.num_steps, *x.shape, device=x.device, generator=torch.Generator(x.device).manual_seed(0))

    def process(mode):
        return reverse_process(model.head, diffusion, z, z, settings.cfg_scale, 1.0, x, noise, mode=mode).mean

    eager_s = timing.median_s(lambda: process(None))
    costs = {"head_process_ms": eager_s * 1e3}
    if mode:
        compiled = process(mode)  # the first call compiles
        compiled_s, eager = timing.median_s(lambda: process(mode)), process(None)
        costs["compiled_head"] = {"head_process_ms": compiled_s * 1e3, "speedup": eager_s / compiled_s,
                                  "apart": float((compiled - eager).abs().mean() / eager.abs().mean())}
    return costs


def reuse_costs(model: MAR, timing: Timing, batch: int, settings: MaskedSettings, tokens, known, vectors, head_call,
                forward_s: float) -> dict:
    """A reusing transformer call and head step beside the full ones (the module doc), at mid-schedule."""
    reuse, L, device = FeatureReuse(), model.cfg.num_tokens, model.device
    lazy = LazyFeatures(model)
    lazy.refresh(tokens[:batch], known[:batch], vectors[:batch], vectors[batch:], L // 2)
    per_step = -(-L // settings.num_iter)
    fresh = torch.arange(L // 2 - per_step, L // 2, device=device).expand(batch, -1)  # fixed at the step before
    needed = torch.arange(L // 2, L // 2 + per_step, device=device).expand(batch, -1)
    keep = reuse.keep(lazy.slots, 2 * per_step)
    call_s = timing.median_s(lambda: lazy.reuse(tokens[:batch], vectors[:batch], fresh, needed, keep))
    x, y, head_step_s = head_call
    kept = HeadCache()
    model.head.guided(x, y, settings.cfg_scale, kept)
    head_s = timing.median_s(lambda: model.head.guided_reusing(x, y[: x.shape[0]], settings.cfg_scale, kept))
    reused_calls = settings.num_iter - sum(reuse.full_steps(settings.num_iter))
    every = reuse.head_refresh_every
    head_mean_s = head_step_s if not every else (head_step_s + (every - 1) * head_s) / every
    full_step_s = forward_s + settings.diffusion_steps * head_step_s
    step_s = ((settings.num_iter - reused_calls) * forward_s + reused_calls * call_s) / settings.num_iter \
        + settings.diffusion_steps * head_mean_s
    return {"call_ms": call_s * 1e3, "call_speedup": forward_s / call_s, "head_step_ms": head_s * 1e3,
            "head_speedup": head_step_s / head_s, "reused_calls": reused_calls, "step_speedup": full_step_s / step_s}


def print_mar_batch(batch: int, entry: dict) -> None:
    print(f"[profile] batch {batch} (CFG, {2 * batch} rows): transformer call {entry['forward_ms']:.1f} ms "
          f"({entry['forward_gflop']:.3g} GFLOP, {entry['forward_gflop'] / entry['forward_ms'] * 1e3:.0f} GFLOP/s; weight floor {entry['floor_ms']:.2f} ms, "
          f"{entry['forward_over_floor']:.1f}x), head {entry['head_step_ms']:.2f} ms per reverse step, "
          f"{entry['head_ms']:.0f} ms per MAR step", flush=True)
    compiled = entry.get("compiled_head")
    if "compiled_forward_ms" in entry:
        print(f"[profile]   compiled transformer call {entry['compiled_forward_ms']:.1f} ms "
              f"({entry['forward_ms'] / entry['compiled_forward_ms']:.2f}x)", flush=True)
    print(f"[profile]   a MAR step's reverse process: {entry['head_process_ms']:.1f} ms eagerly"
          + (f", {compiled['head_process_ms']:.1f} ms compiled ({compiled['speedup']:.2f}x; tokens "
             f"{compiled['apart']:.1e} apart)" if compiled else ""), flush=True)
    reuse = entry["reuse"]
    print(f"[profile]   feature reuse (defaults): a reusing call {reuse['call_ms']:.1f} ms ({reuse['call_speedup']:.2f}x), "
          f"a reusing head step {reuse['head_step_ms']:.2f} ms ({reuse['head_speedup']:.2f}x); {reuse['reused_calls']} "
          f"of {entry['mar_steps']} calls reuse: a MAR step {reuse['step_speedup']:.2f}x faster on average", flush=True)
    for decoder, cost in entry.get("decoders", {}).items():
        print(f"[profile]   {decoder}: {cost['ms_per_iteration']:.1f} ms per target call, "
              f"{cost['target_forwards']:.0f} calls per image, {cost['image_s']:.2f} s per image", flush=True)


def check_mar_options(args) -> None:
    refused = [flag for flag, on in (("--baselines", args.baselines), ("--grid", args.grid),
                                     ("--kernels", args.kernels)) if on]
    if refused:
        raise FastARError(f"{', '.join(refused)}: for token models; a MAR profile times its transformer call, "
                          "its diffusion head (--compile: both compiled too) and whole ar / cspd images")
