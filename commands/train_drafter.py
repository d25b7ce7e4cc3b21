"""Train a drafter for speculative decoding (spec, LANTERN) on the target model's own samples.

    python -m fastar train-drafter [--target MODEL] [--out PATH] [--kind eagle|ar] [--samples N] [--steps N]
        [--captions FILE] [--t5 FOLDER]

1. The target generates ``--samples`` images with plain AR sampling at FastAR's defaults (cfg 2.0, temperature 1,
   no top-k): for random classes (class-to-image), or for prompts (text-to-image: drawn from ``--captions``, one
   per line, else the demo's procedural captions); cached under ``.data/``.
2. Teacher forcing on those tokens, the condition dropped 10% of the time (the null class, or the target's
   unconditional prompt) so that the drafter also learns CFG's unconditional rows (LANTERN, appendix B):
   - ``eagle``: a one-layer EAGLE head in LANTERN's format (LlamaGen c2i/t2i, Lumina-mGPT, Anole) regresses the
     target's next final-norm hidden state (smooth L1) and matches the target's next-token distribution through
     the target's own head (cross-entropy, weight 0.1); its input features get uniform noise (EAGLE's guard
     against its own feature errors when drafting); the token embedding starts from the target's and stays frozen.
   - ``ar``: a small LlamaGen GPT learns the target's next-token distributions (soft cross-entropy).
3. AdamW (0.9, 0.95), linear warm-up then cosine decay. Reported: top-1/top-3 agreement of the
   drafter's first draft with the target's most likely token on held-out target samples.
The defaults retrain the bundled demo drafter (``demo/demo_drafter``) on CPU; ``--target demo/demo_text`` the text
demo's (``demo/demo_text_drafter``).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import FastARError
from ..model_loaders import load_ar_model
from ..model_loaders.chameleon.model import ChameleonGPT
from ..model_loaders.shared.demo import DEMO_AR, demo_drafter_path
from ..model_loaders.drafters.loader import load_drafter, save_eagle_drafter
from ..model_loaders.drafters.eagle import EagleConfig, EagleDrafter, EagleHead, LayoutEagleDrafter
from ..model_loaders.drafters.teacher import teacher_rows
from ..model_loaders.llamagen.model import LlamaGenConfig, LlamaGenGPT
from ..pipeline import resolve_device
from ..samplers.processing import SamplingSettings
from .drafter_samples import Conditions, draw_conditions, read_captions, target_samples
from .training import DATA_DIR, Timer, cosine_lr, init_weights, save_fp16, setup, train_step

CFG_DROP = 0.1  # as the target was trained
POLICY_WEIGHT = 0.1  # EAGLE's weight of the distribution loss against the feature loss


def soft_cross_entropy(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against the target's full next-token distribution, averaged over positions."""
    return -(target_logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()


def eagle_objective(drafter: EagleDrafter, noise: float):
    """(loss, drafter logits, target logits) of a batch; logits predict image tokens 1..N-1."""

    def run(target, conditioning, tokens, drop, generator):
        rows = teacher_rows(target, drafter.token_ids, conditioning, tokens, drop)
        target_logits = drafter.logits(rows.following)
        if noise:
            jitter = torch.rand(rows.hidden.shape, generator=generator, device=rows.hidden.device) - 0.5
            rows.hidden = rows.hidden + noise * jitter.to(rows.hidden.dtype)
        features = drafter.training_features(rows)
        logits = drafter.logits(features)
        feature_loss = F.smooth_l1_loss(features.float(), rows.following.float())
        return feature_loss + POLICY_WEIGHT * soft_cross_entropy(logits, target_logits), logits, target_logits

    return run


def ar_objective(model: LlamaGenGPT):
    def run(target: LlamaGenGPT, conditioning, tokens, drop, generator):
        with torch.no_grad():
            target_logits = target.training_logits(conditioning, tokens, drop)
        logits = model.training_logits(conditioning, tokens, drop)
        return soft_cross_entropy(logits, target_logits), logits, target_logits

    return run


@torch.no_grad()
def agreement(objective, target, tokens, conditions: Conditions, cfg_scale: float, batch: int = 32) -> dict:
    """How often the target's most likely token is the drafter's top-1 / in its top-3, on the cond rows
    alone and after CFG at ``cfg_scale`` (what decoding compares)."""
    hits = {key: 0 for key in ("cond_top1", "cond_top3", "cfg_top1", "cfg_top3")}
    total = 0
    for start in range(0, len(tokens), batch):
        idx = list(range(start, min(start + batch, len(tokens))))
        x, conditioning = tokens[idx].long().to(target.device), conditions.batch(idx)
        keep = torch.zeros(len(idx), dtype=torch.bool, device=target.device)
        _, d_cond, t_cond = objective(target, conditioning, x, keep, None)
        _, d_null, t_null = objective(target, conditioning, x, ~keep, None)
        total += t_cond.shape[0] * t_cond.shape[1]
        for name, drafted, reference in (
            ("cond", d_cond, t_cond),
            ("cfg", d_null + (d_cond - d_null) * cfg_scale, t_null + (t_cond - t_null) * cfg_scale),
        ):
            best = reference.argmax(-1, keepdim=True)
            top3 = drafted.topk(3, dim=-1).indices
            hits[f"{name}_top1"] += (top3[..., :1] == best).sum().item()
            hits[f"{name}_top3"] += (top3 == best).any(-1).sum().item()
    return {key: value / total for key, value in hits.items()}


def agreement_text(scores: dict) -> str:
    return (f"top-1 {scores['cond_top1']:.1%} / top-3 {scores['cond_top3']:.1%} (cond rows), "
            f"top-1 {scores['cfg_top1']:.1%} / top-3 {scores['cfg_top3']:.1%} (with CFG)")


def new_eagle(target) -> EagleDrafter:
    """A head of the target's layer shape; its embedding copied from the target and frozen."""
    if isinstance(target, ChameleonGPT):
        tc = target.cfg
        cfg = EagleConfig(hidden_size=tc.hidden_size, intermediate_size=tc.ffn_hidden, num_attention_heads=tc.n_head,
                          num_key_value_heads=tc.n_kv_head, vocab_size=tc.vocab_size, rms_norm_eps=tc.rms_eps,
                          rope_theta=tc.rope_theta, grid=tuple(tc.grid), family="chameleon", swin_norm=tc.swin_norm,
                          skips_row_ends=tc.row_end is not None)
        embedding, kind = target.backbone.embed_tokens.weight, LayoutEagleDrafter
    else:
        tc = target.cfg
        cfg = EagleConfig(hidden_size=tc.dim, intermediate_size=tc.ffn_hidden, num_attention_heads=tc.n_head,
                          num_key_value_heads=tc.n_kv_head, vocab_size=tc.vocab_size, rms_norm_eps=tc.norm_eps,
                          rope_theta=tc.rope_base, input_type=tc.model_type, grid=tuple(tc.grid))
        embedding, kind = target.tok_embeddings.weight, EagleDrafter
    head = EagleHead(cfg).to(target.device)
    with torch.no_grad():
        head.embed_tokens.weight.copy_(embedding)
    head.embed_tokens.requires_grad_(False)
    return kind(head, target)


def new_small_ar(target: LlamaGenGPT, args) -> LlamaGenGPT:
    tc = target.cfg
    cfg = LlamaGenConfig(dim=args.dim, n_layer=args.layers, n_head=args.heads, vocab_size=tc.vocab_size,
                         grid=tc.grid, model_type=tc.model_type, num_classes=tc.num_classes,
                         class_names=list(tc.class_names), caption_dim=tc.caption_dim, cls_token_num=tc.cls_token_num,
                         norm_eps=tc.norm_eps, rope_base=tc.rope_base)
    model = LlamaGenGPT(cfg)
    init_weights(model)
    return model.to(target.device)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options, shared with ``python -m fastar train-drafter``."""
    p.add_argument("--target", default=str(DEMO_AR), help="target AR checkpoint (default: the bundled demo model)")
    p.add_argument("--out", help="eagle: output folder; ar: output .safetensors (default: a bundled model's drafter)")
    p.add_argument("--kind", choices=("eagle", "ar"), default="eagle",
                   help="eagle: a head on the target's hidden states; ar: a small model of the same family")
    p.add_argument("--samples", type=int, default=2500, help="target samples to train on (generated once)")
    p.add_argument("--captions", help="text-to-image targets: a text file of prompts, one per line, to sample the "
                   "target for (default: the demo's procedural captions)")
    p.add_argument("--t5", help="LlamaGen text-to-image targets: the local FLAN-T5 folder that encodes the prompts")
    p.add_argument("--val-samples", type=int, default=64, help="held-out target samples for the agreement")
    p.add_argument("--steps", type=int, default=900, help="optimiser steps")
    p.add_argument("--batch", type=int, default=32, help="sequences per step")
    p.add_argument("--lr", type=float, default=3e-3,
                   help="peak learning rate (LANTERN trained real drafters at 1e-4, batch 16, for many more steps)")
    p.add_argument("--warmup", type=int, default=100, help="linear warm-up steps")
    p.add_argument("--noise", type=float, default=0.2, help="eagle: width of the uniform noise on input features")
    p.add_argument("--dim", type=int, default=96, help="ar: drafter width")
    p.add_argument("--layers", type=int, default=2, help="ar: drafter layers")
    p.add_argument("--heads", type=int, default=4, help="ar: drafter heads")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--seed", type=int, default=0, help="seed of the samples and the training")
    p.add_argument("--cache-dir", default=str(DATA_DIR), help="where generated target samples are kept")
    p.add_argument("--log-every", type=int, default=50, help="print the loss every N steps")


def train(args) -> dict:
    """Train, save, reload the saved drafter and return its held-out agreement."""
    gen = setup(args.seed)
    timer = Timer()
    device = resolve_device(args.device)
    target = load_ar_model(args.target, device=device)
    check_target(target, args)
    out = Path(args.out) if args.out else demo_drafter_path(args.target) if args.kind == "eagle" else None
    if out is None:
        raise FastARError("--out is needed: a folder for an eagle drafter, a .safetensors path for --kind ar")
    cache_dir = Path(args.cache_dir)
    captions = read_captions(args.captions) if args.captions else None
    encoder = text_encoder(target, args.t5)
    conditions = draw_conditions(target, args.samples, args.seed, captions, encoder)
    val_conditions = draw_conditions(target, args.val_samples, 10_000 + args.seed, captions, encoder)
    tokens = target_samples(target, args.target, conditions, args.seed, 64, cache_dir)
    val_tokens = target_samples(target, args.target, val_conditions, 10_000 + args.seed, 64, cache_dir)
    print(f"{len(tokens)} training and {len(val_tokens)} held-out target samples [{timer}]", flush=True)

    if args.kind == "eagle":
        drafter = new_eagle(target)
        module, objective = drafter.head, eagle_objective(drafter, args.noise)
    else:
        module = new_small_ar(target, args)
        objective = ar_objective(module)
    params = [p for p in module.parameters() if p.requires_grad]
    print(f"{args.kind} drafter: {sum(p.numel() for p in params) / 1e6:.2f}M trained parameters", flush=True)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95))
    noise_gen = torch.Generator(device=device).manual_seed(args.seed)
    module.train()
    for step in range(args.steps):
        idx = torch.randint(0, len(tokens), (args.batch,), generator=gen)
        x = tokens[idx].long().to(device)
        drop = (torch.rand(args.batch, generator=gen) < CFG_DROP).to(device)
        loss, _, _ = objective(target, conditions.batch(idx), x, drop, noise_gen)
        lr = cosine_lr(step, args.steps, args.lr, warmup=min(args.warmup, args.steps // 10 + 1))
        train_step(opt, loss, lr, clip_value=0.5)  # LANTERN's clipping
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            print(f"step {step + 1}/{args.steps} loss {loss.item():.4f} [{timer}]", flush=True)

    module.eval()
    if args.kind == "eagle":
        save_eagle_drafter(drafter, out)
    else:
        save_fp16(module, module.cfg, out)
    saved = load_drafter(out, target)
    check = eagle_objective(saved, 0.0) if args.kind == "eagle" else ar_objective(saved.model)
    scores = agreement(check, target, val_tokens, val_conditions, SamplingSettings().cfg_scale)
    print(f"held-out agreement with the target ({len(val_tokens)} samples, saved weights): "
          f"{agreement_text(scores)}; total {timer}", flush=True)
    return scores


def check_target(target, args) -> None:
    """A clear refusal for what cannot be trained: a target family without an EAGLE format, a small-model drafter
    for a target that is not LlamaGen, prompts for a class-to-image target."""
    if not isinstance(target, (LlamaGenGPT, ChameleonGPT)):
        raise FastARError(f"{Path(args.target).name} is {target.what}: train-drafter trains drafters for LlamaGen "
                          "(class- and text-to-image), Lumina-mGPT and Anole targets; decode it with sjd or gsd")
    if args.kind == "ar" and not isinstance(target, LlamaGenGPT):
        raise FastARError(f"--kind ar trains a small LlamaGen GPT, which drafts for LlamaGen targets only; for "
                          f"{target.what} train an EAGLE head (--kind eagle)")
    if args.captions and getattr(target, "conditioning_kind", "class") == "class":
        raise FastARError(f"--captions: {Path(args.target).name} is a class-to-image model; it samples random classes")


def text_encoder(target, t5_folder):
    """The FLAN-T5 encoder a LlamaGen text-to-image target reads prompts through (None for other targets)."""
    if getattr(target, "conditioning_kind", "class") != "caption":
        return None
    if not t5_folder:
        raise FastARError("this is a LlamaGen text-to-image target: give --t5, the local FLAN-T5 folder that "
                          "encodes its prompts")
    from ..model_loaders.llamagen.t5 import load_t5_encoder

    return load_t5_encoder(t5_folder, device=target.device)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    train(p.parse_args(argv))


if __name__ == "__main__":
    main()
