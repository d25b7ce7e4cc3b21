"""Train the demo MAR models (official MAR key names) on the demo KL autoencoder's latents.

    python -m fastar.demo_recipes.train_mar --size target   # demo_mar.safetensors (about 55 min, 2 CPU threads)
    python -m fastar.demo_recipes.train_mar --size draft    # demo_mar_draft.safetensors, CSpD's draft (distilled)
    python -m fastar.demo_recipes.train_mar --resume FILE   # go on training a saved model (weights only)

Images are drawn from ``demo_data`` for 16-pixel tokens (``make_batch(token=16)``: the smallest shapes, rings,
arms and stripes span a latent token or more, as the 8-pixel set does for the VQ's tokens; measured, 47% of
samples recognised against 34% on the 8-pixel set after 3000 steps) and encoded once with the KL autoencoder
(posterior means and log variances, cached under ``.data/``, keyed by the VAE file's hash); each step samples
the posterior, as MAR's own training does. MAR's scale factor is set so that tokens have unit standard deviation.
Training follows the official recipe at toy size: one random order and one mask ratio per batch, the encoder
sees the class buffer and the unmasked tokens, the diffusion loss (eps MSE plus the variational bound, which
trains the learned variance with the mean frozen) runs on the masked tokens with several timesteps each,
labels drop to the unconditional vector with probability 0.1 for classifier-free guidance, and the saved
weights are an EMA. Departures for a CPU budget, none of which changes the saved model's architecture:
- the mask ratio is uniform on [0.05, 1] (MAR: a truncated normal on [0.7, 1]). Counted per token, MAR's
  cosine schedule generates tokens at mask ratios spread uniformly, and low ratios (many known neighbours)
  are where the model learns that a token follows its neighbours;
- training-only readouts of the condition vectors, discarded when saving (``Readouts``): a linear map to the
  clean masked token (MSE) and logits over k-means clusters of the training tokens (cross-entropy). The
  diffusion loss alone is too faint a signal for the transformer to learn in this budget: without readouts
  samples were right in colour but speckled. The MSE readout brought flat regions with clean edges; the
  cluster cross-entropy (the kind of signal the demo GPT learns its shapes from) did not measurably add to
  it (34% of samples recognised after 96k images, against 41% without it, within the noise of 64 samples);
- position embeddings start from sine-cosine features, and the head's eps at t = 999 gets extra weight
  (``start_error``: MAR's first reverse step amplifies that error ~311x).
The draft learns the target's eps (``--teacher``, the demo target by default) rather than the noise, so that
it follows the target's reverse steps as closely as its size allows: that is what CSpD's acceptance measures.
The head is saved in fp32.
"""
from __future__ import annotations

import argparse
import copy
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..model_loaders import load_ar_model, load_image_decoder
from ..model_loaders.shared.demo import DEMO_KL, DEMO_MAR, DEMO_MAR_DRAFT
from ..model_loaders.mar.diffusion import TRAIN_STEPS, SpacedDiffusion
from ..model_loaders.mar.model import MAR, MARConfig
from ..model_loaders.shared.protocol import ClassConditioning
from ..samplers.masked_loops.masked import MaskedSettings, masked_decode
from .demo_common import OUT_DIR, cached_encoding, to_tensor, to_uint8
from ..commands.training import Timer, cosine_lr, ema_update, save_fp16, setup, train_step
from ..commands.bench.demo_data import CLASS_NAMES, MAR_TOKEN, balanced_labels, make_batch

SIZES = {  # the target is about 4x the draft, as MAR-H is to MAR-B
    "target": dict(dim=192, encoder_depth=3, encoder_heads=6, decoder_dim=192, decoder_depth=3, decoder_heads=6,
                   head_width=256, head_depth=3),
    "draft": dict(dim=96, encoder_depth=1, encoder_heads=3, decoder_dim=96, decoder_depth=1, decoder_heads=3,
                  head_width=128, head_depth=2),
}
OUTPUTS = {"target": DEMO_MAR, "draft": DEMO_MAR_DRAFT}
DEFAULT_STEPS = {"target": 6000, "draft": 3000}
MASK_RATIO_MIN = 0.05
CLUSTERS = 256  # k-means clusters of tokens the cluster readout names
CLUSTER_WEIGHT = 0.5
GRAD_CLIP = 3.0  # MAR's


def encode(vae_path, n: int, seed: int, token: int):
    """(posterior mean, log variance) ``[n, L, C]`` and labels of ``n`` procedural images drawn for
    ``token``-pixel tokens (``demo_data.make_batch``), cached."""
    def encode_batch(vae, rng, count):
        images, labels = make_batch(rng, count, token=token)
        mean, logvar = vae.encode_moments(to_tensor(images))
        return (mean.flatten(2).transpose(1, 2).half(), logvar.flatten(2).transpose(1, 2).half(),
                torch.from_numpy(labels))

    return cached_encoding(f"mar_latents_t{token}", vae_path, n, seed, encode_batch)


def mask_ratio(generator) -> float:
    """Uniform on [MASK_RATIO_MIN, 1] (see the module's docstring)."""
    return MASK_RATIO_MIN + (1 - MASK_RATIO_MIN) * torch.rand(1, generator=generator).item()


def grid_sincos(grid: tuple[int, int], dim: int) -> torch.Tensor:
    """``[h * w, dim]`` 2-D sine-cosine features (half the channels per axis), as MAE initialises positions."""
    quarter = dim // 4
    frequencies = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    rows, cols = torch.meshgrid(torch.arange(grid[0]), torch.arange(grid[1]), indexing="ij")
    angles = [axis.flatten().double().unsqueeze(1) * frequencies for axis in (rows, cols)]
    features = torch.cat([f(a) for a in angles for f in (torch.sin, torch.cos)], dim=1)
    return F.pad(features, (0, dim - features.shape[1])).float()


def init_weights(model: MAR) -> None:
    """MAR's init: xavier-uniform linears with zero bias, normal(0.02) embeddings and learned tokens, the head's
    adaLN modulations and output layer zeroed (every residual block starts as the identity). The learned
    position embeddings start from 2-D sine-cosine features (they stay learned), a head start on which tokens
    are neighbours; measured, it is not enough by itself: a 2500-step target still ignores local context."""
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            nn.init.zeros_(m.bias)
    for p in (model.class_emb.weight, model.fake_latent, model.mask_token, model.encoder_pos_embed_learned,
              model.decoder_pos_embed_learned, model.diffusion_pos_embed_learned):
        nn.init.normal_(p, std=0.02)
    cfg = model.cfg
    with torch.no_grad():
        for p in (model.encoder_pos_embed_learned, model.decoder_pos_embed_learned):
            p[0, cfg.buffer:] += grid_sincos(cfg.grid, p.shape[-1])
        model.diffusion_pos_embed_learned[0] += grid_sincos(cfg.grid, cfg.decoder_dim)
    head = model.head
    for block in [*head.res_blocks, head.final_layer]:
        nn.init.zeros_(block.adaLN_modulation[-1].weight)
        nn.init.zeros_(block.adaLN_modulation[-1].bias)
    nn.init.zeros_(head.final_layer.linear.weight)
    nn.init.zeros_(head.final_layer.linear.bias)


def diffusion_loss(head, diffusion: SpacedDiffusion, x0: torch.Tensor, z: torch.Tensor, generator,
                   teacher: Teacher | None = None) -> torch.Tensor:
    """eps MSE plus the variational bound in bits per dimension (which trains the variance: the mean is frozen
    in it) at uniform timesteps; the last step's term is the Gaussian likelihood of x_0. With a ``teacher``
    the eps target is the teacher's eps for the same x_t instead of the noise."""
    index = torch.randint(0, diffusion.num_steps, (x0.shape[0],), generator=generator)
    noise = torch.randn(x0.shape, generator=generator)
    xt = diffusion.noised(x0, index, noise)
    t = torch.tensor(diffusion.timestep_map)[index]
    eps, variance_values = head(xt, t, z)
    target = noise if teacher is None else teacher.eps(xt, t)
    step = diffusion.reverse_step(xt, index, eps.detach(), variance_values)
    log_var = 2 * torch.log(step.std)
    c = diffusion.constants(index)
    true_mean, true_log_var = diffusion.posterior_mean(x0, xt, c), c["clipped_log_variance"]
    kl = 0.5 * (-1 + log_var - true_log_var + torch.exp(true_log_var - log_var)
                + (true_mean - step.mean).pow(2) * torch.exp(-log_var))
    nll = 0.5 * (math.log(2 * math.pi) + log_var + (x0 - step.mean).pow(2) * torch.exp(-log_var))
    vb = torch.where((index == 0).unsqueeze(-1), nll, kl).mean() / math.log(2.0)
    return F.mse_loss(eps, target) + vb


@dataclass
class Teacher:
    """A trained MAR whose head's eps a draft learns (distillation: the draft then follows the target's
    reverse steps, which is what CSpD's acceptance measures); ``z``: its condition vectors for the batch."""

    model: MAR
    z: torch.Tensor | None = None

    @torch.no_grad()
    def eps(self, xt: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.model.head(xt, t, self.z)[0]


def masked_batch(model: MAR, tokens, labels, generator, repeats: int, teacher: Teacher | None = None):
    """One batch as MAR trains on it: (masked tokens, their condition vectors), each repeated ``repeats``
    times for as many timesteps (the first ``len // repeats`` rows are each token once). A ``teacher``
    gets its own condition vectors for the same masks and labels."""
    B, L, _ = tokens.shape
    order = torch.argsort(torch.rand(B, L, generator=generator), dim=1)
    masked_count = max(1, math.ceil(mask_ratio(generator) * L))
    masked = torch.zeros(B, L, dtype=torch.bool).scatter_(1, order[:, :masked_count], True)
    drop = torch.rand(B, generator=generator) < 0.1  # the unconditional vector, for CFG
    vectors = torch.where(drop.unsqueeze(1), model.fake_latent.expand(B, -1), model.class_emb(labels))
    z = model.conditions(tokens, ~masked, vectors, L - masked_count)
    if teacher is not None:
        with torch.no_grad():
            own = torch.where(drop.unsqueeze(1), teacher.model.fake_latent.expand(B, -1), teacher.model.class_emb(labels))
            teacher.z = teacher.model.conditions(tokens, ~masked, own, L - masked_count)[masked].repeat(repeats, 1)
    return tokens[masked].repeat(repeats, 1), z[masked].repeat(repeats, 1)


# Weight of the t = 999 eps term in training (see start_error). Measured on the demo target (2500 steps):
# held-out RMS error 1.4e-3 where uniform timesteps alone left 0.027 after 1500 steps. An L-BFGS polish of the
# head afterwards (tried: t = 999 alone, then with the uniform term on a fixed batch) overfits its batch: the
# held-out error went 1.4e-3 -> 1.8e-3 and the val loss 0.100 -> 0.123.
START_WEIGHT = 100.0


def start_error(head, diffusion: SpacedDiffusion, x0: torch.Tensor, z: torch.Tensor, noise: torch.Tensor,
                teacher: Teacher | None = None):
    """Mean squared eps error at t = 999. MAR's first reverse step multiplies this error by about 316 (100
    steps; 632 at 50) and the official models get it small in 400 epochs; uniform timesteps in a CPU budget
    leave it at ~0.03 RMS, and samples blow up (token std ~500). At 1.4e-3 outliers remain (token std 2.8 at
    100 steps): it needs a few 1e-4."""
    last = torch.full((x0.shape[0],), diffusion.num_steps - 1)
    xt, t = diffusion.noised(x0, last, noise), torch.tensor(diffusion.timestep_map)[last]
    eps, _ = head(xt, t, z)
    return (eps - (noise if teacher is None else teacher.eps(xt, t))).pow(2).mean()


def token_clusters(tokens: torch.Tensor, k: int, generator, iterations: int = 20) -> torch.Tensor:
    """``[k, C]`` k-means centroids of ``tokens`` [N, C]: k-means++ seeding, then Lloyd's iterations."""
    centroids = tokens[torch.randint(0, len(tokens), (1,), generator=generator)]
    nearest_sq = torch.cdist(tokens, centroids).squeeze(1).pow(2)
    for _ in range(k - 1):  # each next seed drawn in proportion to its squared distance from the seeds so far
        pick = torch.multinomial(nearest_sq + 1e-12, 1, generator=generator)
        centroids = torch.cat([centroids, tokens[pick]])
        nearest_sq = torch.minimum(nearest_sq, (tokens - tokens[pick]).pow(2).sum(1))
    for _ in range(iterations):
        nearest = torch.cdist(tokens, centroids).argmin(1)
        sums = torch.zeros_like(centroids).index_add_(0, nearest, tokens)
        counts = torch.bincount(nearest, minlength=k).unsqueeze(1)
        centroids = torch.where(counts > 0, sums / counts.clamp(min=1), centroids)  # an empty cluster stays
    return centroids


class Readouts(nn.Module):
    """Training-only heads on the condition vectors (see the module's docstring): the clean token by a linear
    map (MSE), and which k-means cluster it falls in (cross-entropy, when ``centroids`` are given)."""

    def __init__(self, cond_dim: int, token_dim: int, centroids: torch.Tensor | None = None):
        super().__init__()
        self.token = nn.Linear(cond_dim, token_dim)
        self.cluster = None if centroids is None else nn.Linear(cond_dim, len(centroids))
        self.register_buffer("centroids", centroids)

    def loss(self, z: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(self.token(z), x0)
        if self.cluster is not None:
            nearest = torch.cdist(x0, self.centroids).argmin(1)
            loss = loss + CLUSTER_WEIGHT * F.cross_entropy(self.cluster(z), nearest)
        return loss


def training_loss(model: MAR, diffusion, tokens, labels, generator, repeats: int,
                  start_weight: float = START_WEIGHT, readouts: Readouts | None = None,
                  teacher: Teacher | None = None) -> torch.Tensor:
    """The diffusion loss on uniform timesteps, plus ``start_weight`` times the t = 999 error, plus the
    ``readouts``' losses when given; eps targets from the ``teacher`` when given."""
    x0, z = masked_batch(model, tokens, labels, generator, repeats, teacher)
    loss = diffusion_loss(model.head, diffusion, x0, z, generator, teacher)
    once = len(x0) // repeats
    if start_weight:
        noise = torch.randn(x0[:once].shape, generator=generator)
        first = None if teacher is None else Teacher(teacher.model, teacher.z[:once])
        loss = loss + start_weight * start_error(model.head, diffusion, x0[:once], z[:once], noise, first)
    if readouts is not None:
        loss = loss + readouts.loss(z[:once], x0[:once])
    return loss


@torch.no_grad()
def eps_error(model: MAR, diffusion, tokens: torch.Tensor, labels: torch.Tensor) -> float:
    """RMS error of the head's eps at t = 999 on ``tokens`` (held out)."""
    generator = torch.Generator().manual_seed(1)
    x0, z = masked_batch(model, tokens, labels, generator, 1)
    return float(start_error(model.head, diffusion, x0, z, torch.randn(x0.shape, generator=generator)) ** 0.5)


@torch.no_grad()
def val_loss(model, diffusion, data, scale, repeats) -> float:
    generator = torch.Generator().manual_seed(0)
    means, _, labels = data
    losses = [training_loss(model, diffusion, m.float() * scale, y, generator, repeats, 0.0).item()
              for m, y in zip(means.split(64), labels.split(64))]
    return float(np.mean(losses))


class Judge:
    """How often the demo classifier recognises the requested class in samples (the number the demo MAR is
    held to), and a grid of them to look at (one column per class)."""

    def __init__(self, vae_path, samples: int, settings: MaskedSettings):
        from ..commands.bench.classifier import load_classifier

        self.vae, self.classifier = load_image_decoder(vae_path), load_classifier()
        self.labels = torch.tensor(balanced_labels(samples))
        self.settings = settings

    @torch.no_grad()
    def __call__(self, model: MAR, grid_path=None) -> float:
        from ..commands.bench.classifier import classify

        tokens, _ = masked_decode(model, ClassConditioning(self.labels), self.settings,
                                  generator=torch.Generator().manual_seed(1))
        images = to_uint8(self.vae.decode_latents(model.decoder_input(tokens)).clamp(-1, 1))
        if grid_path is not None:
            from PIL import Image

            rows = len(images) // len(CLASS_NAMES)
            grid = images.reshape(rows, len(CLASS_NAMES), *images.shape[1:]).transpose(0, 2, 1, 3, 4)
            Image.fromarray(grid.reshape(rows * images.shape[1], -1, 3)).save(grid_path)
        predicted, _ = classify(self.classifier, images)
        return float((predicted == self.labels).float().mean())


# What the demo MAR is judged at: check_demo --mar's and the tests' settings.
JUDGED = MaskedSettings(num_iter=32, cfg_scale=3.0, diffusion_steps=50)
DEMO_DEFAULTS = {"num_iter": JUDGED.num_iter, "cfg": JUDGED.cfg_scale, "diffusion_steps": JUDGED.diffusion_steps}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=SIZES, default="target")
    p.add_argument("--steps", type=int, help="training steps (default: 6000 for the target, 3000 for the draft)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2, help="diffusion timesteps per masked token (MAR: 4)")
    p.add_argument("--images", type=int, default=6000, help="training images (encoded once)")
    p.add_argument("--val-images", type=int, default=128)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--ema", type=float, default=0.998)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vae", default=str(DEMO_KL))
    p.add_argument("--out")
    p.add_argument("--resume", help="start from this saved model's weights (its sizes win; --size still names the "
                                    "output); the optimiser starts afresh, with the same warmup and cosine schedule")
    p.add_argument("--threads", type=int, default=2, help="CPU threads (1 when two trainings share the machine)")
    p.add_argument("--teacher", help="a trained MAR on the same latents whose eps the model learns (default: the "
                                     "demo target for --size draft, none for the target)")
    p.add_argument("--token", type=int, default=MAR_TOKEN, help="pixels per latent token the images are drawn for")
    p.add_argument("--judge-every", type=int, default=0, help="steps between judged samples of the EMA (0 = at the end)")
    args = p.parse_args(argv)
    out = args.out or str(OUTPUTS[args.size])
    args.steps = args.steps or DEFAULT_STEPS[args.size]
    if args.teacher is None and args.size == "draft":
        args.teacher = str(DEMO_MAR)

    gen = setup(args.seed)
    torch.set_num_threads(args.threads)
    timer = Timer()
    train = encode(args.vae, args.images, args.seed, args.token)
    val = encode(args.vae, args.val_images, 10_000 + args.seed, args.token)
    means, logvars, labels = train
    std = torch.exp(0.5 * logvars.float())
    scale = float(1.0 / torch.sqrt(means.float().var() + std.pow(2).mean()))  # posterior samples at unit sd
    print(f"{len(means)} training images encoded, scale factor {scale:.4f} [{timer}]")

    diffusion = SpacedDiffusion(TRAIN_STEPS)
    grid = (int(math.isqrt(means.shape[1])),) * 2
    start = load_ar_model(args.resume).float() if args.resume else None
    teacher = Teacher(load_ar_model(args.teacher).float().requires_grad_(False)) if args.teacher else None
    if teacher is not None:
        scale = teacher.model.cfg.scale_factor  # the same tokens as the teacher's
    cfg = start.cfg if start else MARConfig(**SIZES[args.size], token_dim=means.shape[2], grid=grid, buffer=16,
                                            num_classes=len(CLASS_NAMES), scale_factor=round(scale, 4),
                                            class_names=list(CLASS_NAMES))
    judge = Judge(args.vae, 32, JUDGED)
    model = train_model(cfg, diffusion, (means, std, labels), val, args, gen, timer, start, judge, teacher)
    held_out = val[0][:64].float() * cfg.scale_factor, val[2][:64]
    print(f"eps RMS error at t=999 (held out): {eps_error(model, diffusion, *held_out):.2e}")

    # the head stays fp32: its rounding is amplified too; the defaults are the setting the judge measures
    save_fp16(model, cfg, out, keep_fp32=("diffloss.",), defaults=DEMO_DEFAULTS)
    saved = load_ar_model(out)
    print(f"final val loss (EMA, saved weights, {len(val[0])} held-out images): "
          f"{val_loss(saved, diffusion, val, cfg.scale_factor, args.repeats):.4f}; total {timer}")
    OUT_DIR.mkdir(exist_ok=True)
    grid = OUT_DIR / f"mar_{args.size}_samples.png"
    accuracy = Judge(args.vae, 64, JUDGED)(saved, grid)
    print(f"judge recognises {accuracy:.1%} of 64 samples (32 steps, cfg 3, 50 diffusion steps); grid in "
          f"out/{grid.name} [{timer}]")


def train_model(cfg: MARConfig, diffusion, train, val, args, gen, timer, start: MAR | None = None,
                judge: Judge | None = None, teacher: Teacher | None = None) -> MAR:
    """The whole model trained as MAR trains it (from ``start``'s weights if given); returns the EMA weights.
    ``judge`` rates the EMA's samples every ``args.judge_every`` steps."""
    means, std, labels = train
    model = MAR(cfg)
    if start is None:
        init_weights(model)
    else:
        model.load_state_dict(start.state_dict())
    ema = copy.deepcopy(model).requires_grad_(False)
    print(f"MAR {args.size} {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params")
    sample = means.flatten(0, 1)[torch.randperm(len(means) * means.shape[1], generator=gen)[:50_000]]
    readouts = Readouts(cfg.decoder_dim, cfg.token_dim,
                        token_clusters(sample.float() * cfg.scale_factor, CLUSTERS, gen))
    named = [*model.named_parameters(), *readouts.named_parameters(prefix="readouts")]
    decay = [p for n, p in named if p.dim() >= 2 and "pos_embed" not in n]
    no_decay = [p for n, p in named if p.dim() < 2 or "pos_embed" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.02}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    for step in range(args.steps):
        idx = torch.randint(0, len(means), (args.batch,), generator=gen)
        posterior = means[idx].float() + std[idx] * torch.randn(std[idx].shape, generator=gen)
        loss = training_loss(model, diffusion, posterior * cfg.scale_factor, labels[idx], gen, args.repeats,
                             readouts=readouts, teacher=teacher)
        train_step(opt, loss, cosine_lr(step, args.steps, args.lr, warmup=min(100, args.steps // 10)), clip=GRAD_CLIP)
        # a fresh EMA warms up (short runs); a resumed one starts as the saved model and keeps it in its memory
        ema_update(ema, model, min(args.ema, (1 + step) / (10 + step)) if start is None else args.ema)
        if (step + 1) % 50 == 0:
            print(f"step {step + 1}/{args.steps} loss {loss.item():.4f} [{timer}]", flush=True)
        if (step + 1) % max(1, args.steps // 5) == 0 and step + 1 < args.steps:
            held_out = val[0][:64].float() * cfg.scale_factor, val[2][:64]
            print(f"  val loss (EMA) {val_loss(ema, diffusion, val, cfg.scale_factor, args.repeats):.4f}, "
                  f"eps RMS error at t=999 {eps_error(ema, diffusion, *held_out):.2e}", flush=True)
        if judge is not None and args.judge_every and (step + 1) % args.judge_every == 0:
            print(f"  judge (EMA, 32 samples): {judge(ema):.1%} [{timer}]", flush=True)
    return ema


if __name__ == "__main__":
    main()
