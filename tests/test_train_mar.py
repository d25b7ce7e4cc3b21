"""The demo MAR training's pieces: the mask ratios it draws, the training-only readouts (token and k-means cluster), and --resume."""
import argparse

import torch

from fastar.model_loaders.mar.diffusion import TRAIN_STEPS, SpacedDiffusion
from fastar.model_loaders.mar.model import MAR
from fastar.tests.tiny_mar import mar_config, random_model
from fastar.demo_recipes import train_mar
from fastar.commands.training import Timer


def test_mask_ratios_cover_the_range_inference_visits():
    generator = torch.Generator().manual_seed(0)
    ratios = torch.tensor([train_mar.mask_ratio(generator) for _ in range(4000)])
    assert ratios.min() >= train_mar.MASK_RATIO_MIN and ratios.max() <= 1.0
    # uniform: each quarter of the range gets its share (MAR's own [0.7, 1] would leave three quarters empty)
    counts = torch.histc(ratios, bins=4, min=train_mar.MASK_RATIO_MIN, max=1.0)
    assert bool((counts > 850).all()), counts


def test_the_readouts_add_their_errors_to_the_loss():
    model = random_model(MAR, mar_config(), seed=0)
    tokens, labels = torch.randn(2, 16, 4), torch.tensor([0, 2])
    generator = torch.Generator().manual_seed(5)
    centroids = train_mar.token_clusters(tokens.flatten(0, 1), 6, generator)
    diffusion = SpacedDiffusion(TRAIN_STEPS)

    def loss(readouts):
        return train_mar.training_loss(model, diffusion, tokens, labels, torch.Generator().manual_seed(3), 2,
                                       readouts=readouts)

    plain, token_only = loss(None), loss(train_mar.Readouts(32, 4))
    both = loss(train_mar.Readouts(32, 4, centroids))
    assert plain < token_only < both  # same draws, plus a positive MSE, plus a positive cross-entropy
    both.backward()
    assert model.z_proj.weight.grad.abs().sum() > 0


def test_token_clusters_find_separated_groups():
    generator = torch.Generator().manual_seed(0)
    centres = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    tokens = (centres.repeat(50, 1) + 0.1 * torch.randn(150, 2, generator=generator))
    found = train_mar.token_clusters(tokens, 3, generator)
    # every true centre has a centroid within the noise (Lloyd's alone, from three random tokens, often misses one)
    assert torch.cdist(centres, found).min(1).values.max() < 0.1


def test_resumed_training_starts_from_the_saved_weights_and_its_ema_remembers_them():
    cfg = mar_config()
    start = random_model(MAR, cfg, seed=1)
    data = torch.randn(8, 16, 4), torch.full((8, 16, 4), 0.1), torch.arange(8) % 3
    val = torch.randn(4, 16, 4), torch.zeros(4, 16, 4), torch.arange(4) % 3
    args = argparse.Namespace(size="tiny", steps=3, batch=4, repeats=2, lr=1e-3, ema=0.998, judge_every=0)
    ema = train_mar.train_model(cfg, SpacedDiffusion(TRAIN_STEPS), data, val, args, torch.Generator().manual_seed(0),
                                Timer(), start)
    moved = max((e - s).abs().max().item() for e, s in zip(ema.parameters(), start.parameters()))
    assert 0 < moved < 1e-3  # three steps at decay 0.998 move it a little; a fresh EMA would follow the raw model
    fresh = train_mar.train_model(cfg, SpacedDiffusion(TRAIN_STEPS), data, val, args,
                                  torch.Generator().manual_seed(0), Timer())
    assert max((e - s).abs().max().item() for e, s in zip(fresh.parameters(), start.parameters())) > 1e-2


def test_a_draft_distils_its_teachers_eps_for_the_same_masks():
    model = random_model(MAR, mar_config(), seed=0)
    tokens, labels = torch.randn(3, 16, 4), torch.tensor([0, 2, 1])
    teacher = train_mar.Teacher(random_model(MAR, mar_config(), seed=0))  # the same weights
    x0, z = train_mar.masked_batch(model, tokens, labels, torch.Generator().manual_seed(2), 2, teacher)
    assert torch.equal(teacher.z, z)  # the teacher sees the same masks and dropped labels
    diffusion = SpacedDiffusion(TRAIN_STEPS)
    against_itself = train_mar.diffusion_loss(model.head, diffusion, x0, z, torch.Generator().manual_seed(4), teacher)
    against_noise = train_mar.diffusion_loss(model.head, diffusion, x0, z, torch.Generator().manual_seed(4))
    # same draws: only the eps target differs, and a random head is far from the noise but equals itself
    assert against_itself + 0.5 < against_noise
