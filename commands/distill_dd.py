"""Distil a LlamaGen-format teacher into a Distilled Decoding student (the DD paper's Alg. 1 and 2, which its
authors did not release).

    python -m fastar distill-dd [--teacher MODEL] [--vq VQ] [--out STUDENT] [--per-class N] [--steps N] ...

1. Pairs (``commands/dd_pairs.py``): ``--per-class`` noise sequences per class through the teacher with the
   ``fm`` decoder at the teacher's sampling settings (``--cfg``, ``--top-k`` ...), kept in resumable shards
   under ``--data``.
2. The student starts as the teacher: class embedding, blocks, final norm and logits head copied; the
   continuous input layer is the least-squares map from the code vectors to the teacher's token embeddings
   (so code inputs look as the teacher knows them); the noise/data embedding and the continuous head start
   at zero. It learns the final tokens from ``X_t = (codes of tokens[:t], noise[t:])`` for t in {0, t2}:
   cross-entropy on the logits (weight 0.1, as the paper) plus a distance on the continuous output
   (weight 1): the mean squared error of the images the VQ decoder makes of it (the paper uses LPIPS
   there, whose network weights FastAR cannot download) or, with ``--embedding-loss codes``, in code space.
   Only positions from t on count: the others are given.
3. AdamW (0.9, 0.95), warm-up and cosine decay, EMA; saved as fp16 safetensors with the released students'
   key names plus FastAR's config (split, t2, the teacher's fingerprint), so it loads like a released one.
   ``--resume STUDENT`` continues from a saved student. The same code runs on a GPU for real teachers.
"""
from __future__ import annotations

import argparse
import copy
from dataclasses import fields
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import FastARError
from ..model_loaders import load_ar_model, load_image_decoder
from ..model_loaders.dd.student import DEFAULT_T2, DDStudent, DDStudentConfig, model_fingerprint
from ..model_loaders.shared.demo import DEMO_AR, DEMO_DD, DEMO_VAR_DD, demo_image_decoder
from ..model_loaders.llamagen.model import LlamaGenConfig, LlamaGenGPT
from ..model_loaders.var.dd_student import OFFICIAL_SCALES, VARDDConfig, VARDDStudent
from ..model_loaders.var.model import VAR, VARConfig
from ..pipeline import check_image_decoder, resolve_device
from .dd_pairs import PairSettings, load_pairs, make_pairs, token_count
from .training import DATA_DIR, Timer, cosine_lr, ema_update, save_fp16, setup, train_step

LOGIT_WEIGHT, EMBEDDING_WEIGHT = 0.1, 1.0  # the DD paper's weights (CE 0.1, LPIPS 1.0)


def student_from_teacher(teacher: LlamaGenGPT, codebook: torch.Tensor, split: int, t2: int) -> DDStudent:
    """A student that starts as the teacher (see the module doc), in fp32 on the teacher's device."""
    shared = {f.name: getattr(teacher.cfg, f.name) for f in fields(LlamaGenConfig)}
    cfg = DDStudentConfig(**shared, channels=codebook.shape[1], split=split, t2=t2,
                          teacher=model_fingerprint(teacher))
    student = DDStudent(cfg).to(teacher.device)
    copied = {k: v for k, v in teacher.state_dict().items() if not k.startswith("tok_embeddings.")}
    missing, _ = student.load_state_dict(copied, strict=False)
    with torch.no_grad():
        inputs = torch.cat([codebook.float(), torch.ones(len(codebook), 1, device=codebook.device)], dim=1)
        fit = torch.linalg.lstsq(inputs, teacher.tok_embeddings.weight.float()).solution  # [C + 1, dim]
        student.tok_embeddings.weight.copy_(fit[:-1].T)
        student.tok_embeddings.bias.copy_(fit[-1])
        for name in missing:
            if not name.startswith("tok_embeddings."):
                student.get_parameter(name).zero_()
    return student.float()


def var_student_from_teacher(teacher: VAR, codebook: torch.Tensor, split: int, t2: int) -> VARDDStudent:
    """A VAR-DD student that starts as its VAR teacher: class embedding, blocks, heads and input layer copied;
    the extra leading level and position start as the teacher's first ones (its class slot and first token now
    sit in two slots); the data/noise embeddings and the continuous head start at zero."""
    shared = {f.name: getattr(teacher.cfg, f.name) for f in fields(VARConfig)}
    cfg = VARDDConfig(**shared, split=split, t2=t2, teacher=model_fingerprint(teacher))
    student = VARDDStudent(cfg).to(teacher.device)
    theirs = teacher.state_dict()
    copied = {k: v for k, v in theirs.items() if k not in ("pos_1LC", "lvl_embed.weight", "lvl_1L",
                                                           "attn_bias_for_masking")}
    missing, _ = student.load_state_dict(copied, strict=False)
    with torch.no_grad():
        student.pos_1LC.copy_(torch.cat([theirs["pos_1LC"][:, :1], theirs["pos_1LC"]], dim=1))
        student.lvl_embed.weight.copy_(torch.cat([theirs["lvl_embed.weight"][:1], theirs["lvl_embed.weight"]]))
        for name in missing:
            if name not in ("pos_1LC", "lvl_embed.weight", "lvl_1L", "attn_bias_for_masking"):
                student.get_parameter(name).zero_()
    return student.float()


def default_t2(teacher) -> int:
    """The second step's data length: 80 tokens for a raster teacher (the released LlamaGen-DD), the release's
    number of scales for a VAR (5 for d16, 4 otherwise, at most all but the last)."""
    if getattr(teacher, "kind", None) != "next-scale":
        return DEFAULT_T2
    scales = min(OFFICIAL_SCALES.get(teacher.cfg.depth, 4), len(teacher.cfg.patch_nums) - 1)
    return scale_ends(teacher.cfg.patch_nums)[scales - 1]


def scale_ends(patch_nums) -> list[int]:
    """Tokens up to the end of each scale."""
    return torch.tensor([p * p for p in patch_nums]).cumsum(0).tolist()


def dd_loss(student: DDStudent, noise, tokens, labels, t, codebook, vq=None, logit_weight=LOGIT_WEIGHT,
            embedding_weight=EMBEDDING_WEIGHT):
    """The distillation loss of one batch at data lengths ``t`` [B]: (total, cross-entropy, distance)."""
    target = codebook[tokens]
    position = torch.arange(tokens.shape[1], device=tokens.device)[None]
    later = position >= t[:, None]  # what the student must predict; earlier positions are given
    x_t = torch.where(later[..., None], noise, target)
    continuous, logits = student.predict(x_t, labels, t)
    ce = F.cross_entropy(logits[later], tokens[later])
    if vq is None:
        distance = (continuous - target).square().sum(-1)[later].mean()
    else:
        predicted = torch.where(later[..., None], continuous, target)
        with torch.no_grad():
            reference = vq.decode(student.decoder_input(target))
        distance = F.mse_loss(vq.decode(student.decoder_input(predicted)), reference)
    return logit_weight * ce + embedding_weight * distance, ce, distance


@torch.no_grad()
def held_out_scores(student: DDStudent, pairs: dict, codebook, ts: tuple[int, ...], batch: int = 32) -> dict:
    """Per data length: token accuracy of the greedy logits and RMS error of the continuous output, on the
    positions the student predicts."""
    scores = {}
    for t in ts:
        hits = total = sq = 0.0
        for start in range(0, len(pairs["tokens"]), batch):
            noise, tokens, labels = (pairs[k][start : start + batch].to(student.device) for k in ("noise", "tokens", "labels"))
            steps = torch.full((len(tokens),), t, device=student.device)
            target = codebook[tokens]
            x_t = torch.cat([target[:, :t], noise[:, t:]], dim=1)
            continuous, logits = student.predict(x_t, labels, steps)
            hits += (logits[:, t:].argmax(-1) == tokens[:, t:]).sum().item()
            sq += (continuous[:, t:] - target[:, t:]).square().sum().item()
            total += tokens[:, t:].numel()
        scores[t] = (hits / total, (sq / total) ** 0.5)
    return scores


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--teacher", default=str(DEMO_AR), help="LlamaGen-format c2i teacher (default: the demo model)")
    p.add_argument("--vq", default=None, help="the teacher's VQ decoder (default: the demo VQ for the demo teacher)")
    p.add_argument("--out", help=f"student .safetensors (default: {DEMO_DD.name} beside the demo model)")
    p.add_argument("--data", help="folder for the noise/code pairs (default: .data/dd_pairs_<teacher fingerprint>_<settings>)")
    p.add_argument("--per-class", type=int, default=PairSettings.per_class, help="pairs per class")
    p.add_argument("--classes", help="comma-separated class indices (default: all)")
    p.add_argument("--cfg", type=float, default=PairSettings.cfg_scale, help="the teacher's guidance for the pairs")
    p.add_argument("--temperature", type=float, default=PairSettings.temperature,
                   help="the teacher's sampling temperature for the training pairs")
    p.add_argument("--top-k", type=int, default=PairSettings.top_k, help="the teacher's top-k for the pairs (0 = off)")
    p.add_argument("--top-p", type=float, default=PairSettings.top_p, help="the teacher's top-p for the pairs (1 = off)")
    p.add_argument("--flow-steps", type=int, default=PairSettings.flow_steps, help="solver steps of the flow map")
    p.add_argument("--shard-size", type=int, default=PairSettings.shard_size, help="pairs per shard (and batch)")
    p.add_argument("--pairs-only", action="store_true", help="make the pairs and stop")
    p.add_argument("--t2", type=int, help=f"the second step's data length in tokens (default: {DEFAULT_T2}; for a VAR "
                                          "the first scales up to the release's rule, e.g. 55 = 5 scales for d16)")
    p.add_argument("--split", type=int, help="greedy codes before it, continuous outputs from it (default: t2)")
    p.add_argument("--steps", type=int, default=3000, help="optimiser steps")
    p.add_argument("--batch", type=int, default=32, help="training pairs per step")
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (the paper: 1e-4 at batch 256)")
    p.add_argument("--ema", type=float, default=0.999, help="decay of the weights' moving average (what is saved)")
    p.add_argument("--bf16", action="store_true",
                   help="train under bfloat16 autocast (weights stay fp32): faster on GPUs and AVX-512 BF16 CPUs")
    p.add_argument("--embedding-loss", choices=("pixels", "codes"), default="pixels",
                   help="distance of the continuous output: MSE of the decoded images, or of the code vectors")
    p.add_argument("--logit-weight", type=float, default=LOGIT_WEIGHT, help="weight of the logits' loss")
    p.add_argument("--embedding-weight", type=float, default=EMBEDDING_WEIGHT,
                   help="weight of the code-embedding loss")
    p.add_argument("--val-fraction", type=float, default=0.05, help="pairs held out for the scores")
    p.add_argument("--resume", help="a saved student to continue from (its config wins)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--seed", type=int, default=0, help="seed of the pairs' noise and the training")
    p.add_argument("--log-every", type=int, default=50, help="print the losses every N steps")
    p.add_argument("--save-every", type=int, default=500,
                   help="write the student (EMA weights) every N steps, so an interrupted run keeps its progress")


def distill(args) -> dict:
    gen = setup(args.seed)
    timer = Timer()
    device = resolve_device(args.device)
    teacher = load_ar_model(args.teacher, device=device)
    is_var = getattr(teacher, "kind", None) == "next-scale"
    if not is_var and (not isinstance(teacher, LlamaGenGPT) or teacher.cfg.model_type != "c2i"):
        raise FastARError(f"{Path(args.teacher).name}: distill-dd distils class-to-image LlamaGen-format and VAR "
                          "teachers")
    vq_path = args.vq or demo_image_decoder(args.teacher)
    if vq_path is None:
        raise FastARError("give the teacher's image decoder (--vq: its VQ, or a VAR's VQVAE): its codebook is the "
                          "space DD works in")
    vq = load_image_decoder(vq_path, device=device)
    check_image_decoder(teacher, vq)
    codebook = vq.codebook().float()
    n_tokens = token_count(teacher)
    args.t2 = args.t2 if args.t2 is not None else default_t2(teacher)
    split = args.t2 if args.split is None else args.split
    if not 0 < args.t2 < n_tokens or not 0 <= split <= n_tokens:
        raise FastARError(f"--t2 {args.t2} must lie in 1..{n_tokens - 1} and --split {split} in 0..{n_tokens}")
    if is_var and args.t2 not in scale_ends(teacher.cfg.patch_nums):
        raise FastARError(f"--t2 {args.t2}: a VAR student's second step is given whole scales, so t2 is one of "
                          f"{scale_ends(teacher.cfg.patch_nums)[:-1]} tokens")
    classes = [int(c) for c in args.classes.split(",")] if args.classes else list(range(teacher.cfg.num_classes))
    settings = PairSettings(args.cfg, args.temperature, args.top_k, args.top_p, args.flow_steps, args.per_class,
                            args.shard_size, args.seed)
    data = Path(args.data) if args.data else DATA_DIR / f"dd_pairs_{model_fingerprint(teacher)}_{settings.tag()}"
    make_pairs(teacher, codebook, data, classes, settings, vqvae=vq if is_var else None)
    print(f"pairs in {data} [{timer}]", flush=True)
    if args.pairs_only:
        return {}

    pairs = load_pairs(data)
    order = torch.randperm(len(pairs["tokens"]), generator=gen)
    held = max(1, int(len(order) * args.val_fraction))
    val = {k: v[order[:held]] for k, v in pairs.items()}
    train = {k: v[order[held:]].to(device) for k, v in pairs.items()}
    if args.resume:
        student = load_ar_model(args.resume, device=device)
        if getattr(student, "kind", None) != "few-step" or student.cfg.teacher != model_fingerprint(teacher):
            raise FastARError(f"{args.resume} is not a student of this teacher: resume a file distill-dd wrote for it")
        student = student.float().requires_grad_(True)
    else:
        start = var_student_from_teacher if is_var else student_from_teacher
        student = start(teacher, codebook, split, args.t2)
    ts = torch.tensor([0, student.cfg.t2], device=device)
    del teacher
    print(f"student {sum(p.numel() for p in student.parameters()) / 1e6:.2f}M params, {len(train['tokens'])} "
          f"training and {held} held-out pairs, split {student.cfg.split}, t2 {student.cfg.t2} [{timer}]", flush=True)
    out = Path(args.out) if args.out else DEMO_VAR_DD if is_var else DEMO_DD
    ema = copy.deepcopy(student).eval().requires_grad_(False)
    opt = torch.optim.AdamW(student.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    decoder = vq if args.embedding_loss == "pixels" else None
    student.train()
    for step in range(args.steps):
        idx = torch.randint(0, len(train["tokens"]), (args.batch,), generator=gen).to(device)
        t = ts[torch.randint(0, len(ts), (args.batch,), generator=gen).to(device)]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            loss, ce, distance = dd_loss(student, train["noise"][idx], train["tokens"][idx], train["labels"][idx], t,
                                         codebook, decoder, args.logit_weight, args.embedding_weight)
        train_step(opt, loss, cosine_lr(step, args.steps, args.lr, warmup=min(200, args.steps // 10 + 1)), clip=1.0)
        ema_update(ema, student, min(args.ema, (1 + step) / (10 + step)) if not args.resume else args.ema)
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            print(f"step {step + 1}/{args.steps} loss {loss.item():.4f} (ce {ce.item():.3f}, distance "
                  f"{distance.item():.4f}) [{timer}]", flush=True)
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            save_fp16(ema, ema.cfg, out)
    saved = load_ar_model(out, device=device)
    scores = held_out_scores(saved.float(), val, codebook, (0, saved.cfg.t2))
    for t, (accuracy, rms) in scores.items():
        print(f"held out, data length {t}: token accuracy {accuracy:.1%}, continuous RMS error {rms:.3f}")
    print(f"total {timer}", flush=True)
    return scores


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    distill(p.parse_args(argv))


if __name__ == "__main__":
    main()
