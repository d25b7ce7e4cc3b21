"""Train a drafter for speculative decoding (LANTERN) on the target model's own samples.

    python -m fastar train-drafter [--target MODEL] [--out PATH] [--kind eagle|ar] [--samples N] [--steps N]

1. The target generates ``--samples`` images with plain AR sampling at FastAR's defaults (cfg 2.0,
   temperature 1, no top-k) for random classes (cached under ``.data/``, keyed by the target file's hash).
2. Teacher forcing on those tokens, the class dropped to the null class 10% of the time so that the
   drafter also learns CFG's unconditional rows (LANTERN, appendix B):
   - ``eagle``: a one-layer EAGLE head in LANTERN's format regresses the target's next final-norm hidden
     state (smooth L1) and matches the target's next-token distribution through the target's own head
     (cross-entropy, weight 0.1); its input features get uniform noise (EAGLE's guard against its own
     feature errors when drafting); the token embedding starts from the target's and stays frozen.
   - ``ar``: a small LlamaGen GPT learns the target's next-token distributions (soft cross-entropy).
3. AdamW (0.9, 0.95), linear warm-up then cosine decay. Reported: top-1/top-3 agreement of the
   drafter's first draft with the target's most likely token on held-out target samples.
The defaults retrain the bundled demo drafter (``demo/demo_drafter``) on CPU. Class-to-image targets
only (a text-to-image target would need a caption set to sample from).
"""
from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import FastARError
from ..model_loaders import load_ar_model
from ..model_loaders.shared.demo import DEMO_AR, DEMO_DRAFTER
from ..model_loaders.drafters.loader import load_drafter, save_eagle_drafter
from ..model_loaders.drafters.eagle import EagleConfig, EagleDrafter, EagleHead
from ..model_loaders.llamagen.model import LlamaGenConfig, LlamaGenGPT
from ..model_loaders.shared.protocol import ClassConditioning
from ..pipeline import resolve_device
from ..samplers.token_loops.jacobi import ar_decode
from ..samplers.processing import SamplingSettings
from .training import DATA_DIR, Timer, cosine_lr, init_weights, save_fp16, save_whole, setup, train_step

CFG_DROP = 0.1  # as the target was trained
POLICY_WEIGHT = 0.1  # EAGLE's weight of the distribution loss against the feature loss


@torch.no_grad()
def target_samples(target: LlamaGenGPT, path, n: int, seed: int, batch: int, cache_dir: Path):
    """(tokens [n, N], labels [n]) sampled from the target; cached when the target is a single file."""
    cache = None
    if Path(path).is_file():
        digest = hashlib.sha1(Path(path).read_bytes()).hexdigest()[:12]
        cache = cache_dir / f"drafter_samples_{digest}_s{seed}_n{n}.pt"
        if cache.exists():
            return torch.load(cache)
    generator = torch.Generator(device=target.device).manual_seed(seed)
    tokens, labels = [], []
    for start in range(0, n, batch):
        y = torch.randint(0, target.cfg.num_classes, (min(batch, n - start),), generator=generator,
                          device=target.device)
        codes, _ = ar_decode(target, ClassConditioning(y), SamplingSettings(), generator=generator)
        tokens.append(codes.cpu().to(torch.int16))
        labels.append(y.cpu())
        print(f"sampled {start + len(y)}/{n} target images", flush=True)
    data = torch.cat(tokens), torch.cat(labels)
    if cache is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        save_whole(data, cache)
    return data


def soft_cross_entropy(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against the target's full next-token distribution, averaged over positions."""
    return -(target_logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()


def eagle_objective(drafter: EagleDrafter, noise: float):
    """(loss, drafter logits, target logits) of a batch; logits predict image tokens 1..N-1."""

    def run(target: LlamaGenGPT, conditioning, tokens, drop, generator):
        with torch.no_grad():
            hidden = target.training_hidden(conditioning, tokens, drop)
            nxt = hidden[:, hidden.shape[1] - tokens.shape[1] + 1 :]  # slot of row p + 1
            target_logits = target.output(nxt).float()
            if noise:
                jitter = torch.rand(hidden.shape, generator=generator, device=hidden.device) - 0.5
                hidden = hidden + noise * jitter.to(hidden.dtype)
        features = drafter.training_features(hidden, tokens)
        logits = target.output(features).float()
        feature_loss = F.smooth_l1_loss(features.float(), nxt.float())
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
def agreement(objective, target, tokens, labels, cfg_scale: float, batch: int = 32) -> dict:
    """How often the target's most likely token is the drafter's top-1 / in its top-3, on the cond rows
    alone and after CFG at ``cfg_scale`` (what decoding compares)."""
    hits = {key: 0 for key in ("cond_top1", "cond_top3", "cfg_top1", "cfg_top3")}
    total = 0
    for x, y in zip(tokens.split(batch), labels.split(batch)):
        x, y = x.long().to(target.device), y.to(target.device)
        conditioning = ClassConditioning(y)
        _, d_cond, t_cond = objective(target, conditioning, x, torch.zeros_like(y, dtype=torch.bool), None)
        _, d_null, t_null = objective(target, conditioning, x, torch.ones_like(y, dtype=torch.bool), None)
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


def new_eagle(target: LlamaGenGPT) -> EagleDrafter:
    """A head of the target's layer shape; its embedding copied from the target and frozen."""
    tc = target.cfg
    cfg = EagleConfig(hidden_size=tc.dim, intermediate_size=tc.ffn_hidden, num_attention_heads=tc.n_head,
                      num_key_value_heads=tc.n_kv_head, vocab_size=tc.vocab_size, rms_norm_eps=tc.norm_eps,
                      rope_theta=tc.rope_base, input_type=tc.model_type, grid=tuple(tc.grid))
    head = EagleHead(cfg).to(target.device)
    with torch.no_grad():
        head.embed_tokens.weight.copy_(target.tok_embeddings.weight)
    head.embed_tokens.requires_grad_(False)
    return EagleDrafter(head, target)


def new_small_ar(target: LlamaGenGPT, args) -> LlamaGenGPT:
    tc = target.cfg
    cfg = LlamaGenConfig(dim=args.dim, n_layer=args.layers, n_head=args.heads, vocab_size=tc.vocab_size,
                         grid=tc.grid, num_classes=tc.num_classes, class_names=list(tc.class_names),
                         norm_eps=tc.norm_eps, rope_base=tc.rope_base)
    model = LlamaGenGPT(cfg)
    init_weights(model)
    return model.to(target.device)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options, shared with ``python -m fastar train-drafter``."""
    p.add_argument("--target", default=str(DEMO_AR), help="target AR checkpoint (default: the bundled demo model)")
    p.add_argument("--out", help="eagle: output folder; ar: output .safetensors (default: the demo drafter)")
    p.add_argument("--kind", choices=("eagle", "ar"), default="eagle",
                   help="eagle: a head on the target's hidden states; ar: a small model of the same family")
    p.add_argument("--samples", type=int, default=2500, help="target samples to train on (generated once)")
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
    if not isinstance(target, LlamaGenGPT) or target.cfg.model_type != "c2i":
        raise FastARError(f"{Path(args.target).name}: train-drafter trains on class-to-image LlamaGen targets; "
                          "a text-to-image target would need captions to sample from")
    out = Path(args.out) if args.out else DEMO_DRAFTER if args.kind == "eagle" else None
    if out is None:
        raise FastARError("--kind ar needs --out (a .safetensors path)")
    cache_dir = Path(args.cache_dir)
    tokens, labels = target_samples(target, args.target, args.samples, args.seed, 64, cache_dir)
    val_tokens, val_labels = target_samples(target, args.target, args.val_samples, 10_000 + args.seed, 64, cache_dir)
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
        x, y = tokens[idx].long().to(device), labels[idx].to(device)
        drop = (torch.rand(args.batch, generator=gen) < CFG_DROP).to(device)
        loss, _, _ = objective(target, ClassConditioning(y), x, drop, noise_gen)
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
    scores = agreement(check, target, val_tokens, val_labels, SamplingSettings().cfg_scale)
    print(f"held-out agreement with the target ({len(val_tokens)} samples, saved weights): "
          f"{agreement_text(scores)}; total {timer}", flush=True)
    return scores


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    train(p.parse_args(argv))


if __name__ == "__main__":
    main()
