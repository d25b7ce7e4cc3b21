"""MAR's math pinned: the respaced cosine diffusion (values from the official code), the mask and CFG
schedules with their clamps, the sampler's trajectory noise and refusals, on a tiny random MAR."""
import math

import pytest
import torch

from fastar.errors import FastARError
from fastar.model_loaders.mar.diffusion import SpacedDiffusion, respaced_steps
from fastar.model_loaders.mar.model import MAR, MARConfig
from fastar.model_loaders.shared.protocol import ClassConditioning
from fastar.samplers.masked_loops.head_steps import reverse_process
from fastar.samplers.masked_loops.masked import MaskedSettings, cfg_at, mask_schedule, masked_decode

# (index, log beta, clipped posterior log-variance, sqrt(1/ac), sqrt(1/ac - 1), coef x0, coef xt) of the
# official create_diffusion("100", noise_schedule="cosine")
OFFICIAL_100 = [
    (0, -10.09503009653447, -10.15394511055059, 1.000020642751578, 0.006425412771141183, 1.0, 0.0),
    (1, -7.293652980830654, -10.15394511055059, 1.0003607432229893, 0.02686292206092787, 0.9427674281100751,
     0.05723256838029648),
    (50, -3.376357423733981, -3.410175196467124, 1.4366651769715875, 1.0315070677037568, 0.0469491558461448,
     0.9500863770173814),
    (99, -1.0000851416131292e-05, -0.00025288514517641907, 20291.169634711496, 20291.169610070236,
     0.015583721365743979, 0.003161636366245914),
]


def test_respaced_cosine_schedule_matches_the_official_tables():
    d = SpacedDiffusion(100)
    assert d.timestep_map[:6] == [0, 10, 20, 30, 40, 50] and d.timestep_map[-3:] == [979, 989, 999]
    names = ("log_beta", "clipped_log_variance", "recip_sqrt_ac", "recip_sqrt_ac_m1", "coef_x0", "coef_xt")
    for index, *values in OFFICIAL_100:
        for name, value in zip(names, values):
            assert float(d.table[name][index]) == pytest.approx(value, rel=1e-5, abs=1e-7), (index, name)
    assert respaced_steps(250)[:3] == [0, 4, 8] and len(respaced_steps(250)) == 250
    with pytest.raises(FastARError, match="diffusion steps 0"):
        SpacedDiffusion(0)


def test_reverse_step_blends_the_learned_variance_range():
    d = SpacedDiffusion(10)
    x, eps = torch.randn(5, 4), torch.randn(5, 4)
    low = d.reverse_step(x, 3, eps, -torch.ones(5, 4))
    high = d.reverse_step(x, 3, eps, torch.ones(5, 4))
    assert torch.allclose(low.std, torch.exp(0.5 * d.table["clipped_log_variance"][3]).expand(5, 4))
    assert torch.allclose(high.std, torch.exp(0.5 * d.table["log_beta"][3]).expand(5, 4))
    x0 = d.table["recip_sqrt_ac"][3] * x - d.table["recip_sqrt_ac_m1"][3] * eps
    assert torch.allclose(low.mean, d.table["coef_x0"][3] * x0 + d.table["coef_xt"][3] * x)


def test_mask_schedule_is_the_clamped_cosine_and_ends_empty():
    m = mask_schedule(256, 64)
    assert m[:4] == [256, 255, 254, 253]  # floor(256 cos) stays 255 at first: the clamp to m - 1 decides
    assert m[32] == math.floor(256 * math.cos(math.pi / 4)) == 181  # later the cosine does
    for L, K in ((256, 64), (16, 16), (16, 15), (10, 3), (5, 1)):
        m = mask_schedule(L, K)
        assert m[0] == L and m[-1] == 0 and len(m) == K + 1
        assert all(a > b for a, b in zip(m, m[1:]))  # every step fixes at least one token
        assert all(b >= 1 for b in m[1:-1])  # at least one masked token before the last step
    assert mask_schedule(16, 16) == list(range(16, -1, -1))  # the clamp to m - 1 takes over


def test_linear_cfg_uses_the_clamped_length_and_never_reaches_the_nominal_scale():
    settings = MaskedSettings(num_iter=8, cfg_scale=3.0)
    m = mask_schedule(256, 8)
    scales = [cfg_at(settings, 256, after) for after in m[1:]]
    assert scales == sorted(scales) and scales[0] > 1.0
    assert scales[-1] == pytest.approx(1 + 2.0 * 255 / 256) and scales[-1] < 3.0
    assert cfg_at(MaskedSettings(cfg_scale=3.0, cfg_schedule="constant"), 256, 100) == 3.0


def tiny_mar(seed=0, classes=4):
    torch.manual_seed(seed)
    cfg = MARConfig(dim=32, encoder_depth=1, encoder_heads=2, decoder_dim=32, decoder_depth=1, decoder_heads=2,
                    head_width=32, head_depth=2, token_dim=4, grid=(3, 3), buffer=2, num_classes=classes)
    model = MAR(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model


def decode(model, settings, seed=0, labels=(1, 2)):
    return masked_decode(model, ClassConditioning(torch.tensor(labels)), settings,
                         generator=torch.Generator().manual_seed(seed))


def test_sampler_is_seeded_fixes_every_token_once_and_counts_its_calls():
    model = tiny_mar()
    settings = MaskedSettings(num_iter=4, cfg_scale=2.0, diffusion_steps=5)
    tokens, stats = decode(model, settings)
    again, _ = decode(model, settings)
    other, _ = decode(model, settings, seed=1)
    assert tokens.shape == (2, 9, 4) and torch.equal(tokens, again) and not torch.equal(tokens, other)
    assert stats.target_forwards == 4 and stats.step_compression == pytest.approx(9 / 4)
    assert [sum(row) for row in zip(*stats.fixed_per_forward)] == [9, 9]
    assert sorted(set(stats.fixed_at[0])) == [1, 2, 3, 4]


def test_temperature_scales_the_reverse_noise_not_the_start():
    """Near temperature 0 the trajectory's noise no longer matters but its start x_T does; at 1 both do."""
    model = tiny_mar()
    d = model.diffusion(6)
    z = torch.randn(5, 32)
    start, other_start = torch.randn(5, 4), torch.randn(5, 4)
    noise, other_noise = torch.randn(6, 5, 4), torch.randn(6, 5, 4)

    def run(temperature, x_t, n):
        return reverse_process(model.head, d, z, None, 1.0, temperature, x_t, n).mean

    cold = run(1e-6, start, noise)
    assert torch.allclose(cold, run(1e-6, start, other_noise), atol=1e-4)
    assert not torch.allclose(cold, run(1e-6, other_start, noise), atol=1e-2)
    assert not torch.allclose(run(1.0, start, noise), run(1.0, start, other_noise), atol=1e-2)


@pytest.mark.parametrize("changes,message", [
    ({"num_iter": 10}, "num_iter 10: .* 1 to 9 steps"),
    ({"num_iter": 0}, "num_iter 0"),
    ({"cfg_scale": 0.5}, "cfg scale"),
    ({"temperature": 0.0}, "positive temperature"),
    ({"cfg_schedule": "cosine"}, "CFG schedule"),
])
def test_bad_sampler_settings_are_refused(changes, message):
    with pytest.raises(FastARError, match=message):
        decode(tiny_mar(), MaskedSettings(diffusion_steps=3, **{"num_iter": 3, **changes}))


class Cancelled(Exception):
    pass


def test_cancel_is_honoured_inside_a_step_s_diffusion_loop():
    """Under a registered check (ComfyUI's Cancel, interrupts.py) the reverse process checks before each of its
    steps: a cancel during the first MAR step's diffusion ends the run there, before the step's progress call."""
    from fastar.interrupts import interruptible

    calls, progress = [], []

    def check():
        calls.append(1)
        if len(calls) == 3:
            raise Cancelled

    model = tiny_mar()
    with pytest.raises(Cancelled), interruptible(check):
        masked_decode(model, ClassConditioning(torch.tensor([1])), MaskedSettings(num_iter=4, diffusion_steps=5),
                      generator=torch.Generator().manual_seed(0), on_iteration=lambda *a: progress.append(a))
    assert len(calls) == 3 and progress == []
    tokens, _ = decode(model, MaskedSettings(num_iter=4, diffusion_steps=5))  # no check registered: runs to the end
    assert tokens.shape == (2, 9, 4)


def test_the_official_path_and_the_masked_path_give_the_same_condition_vectors():
    """With the count every row knows (the sampler's schedule gives it) the encoder drops the unknown tokens, as
    the official code does; without it (CSpD's contexts of different lengths) it masks them out of attention.
    The same vectors either way, in scattered orders of known tokens, with CFG's unconditional rows."""
    model = tiny_mar(0)
    g = torch.Generator().manual_seed(5)
    L = model.cfg.num_tokens
    tokens = torch.randn(3, L, model.cfg.token_dim, generator=g)
    known = torch.zeros(3, L, dtype=torch.bool).scatter_(1, torch.argsort(torch.rand(3, L, generator=g), 1)[:, :5], True)
    vectors = torch.cat([model.class_emb(torch.tensor([1, 2])), model.fake_latent])
    with torch.no_grad():
        dropped = model.conditions(tokens, known, vectors, 5)
        masked = model.conditions(tokens, known, vectors)
    assert torch.allclose(dropped, masked, atol=1e-5)
    assert not torch.allclose(dropped[:, known[0]], model.conditions(tokens, ~known, vectors)[:, known[0]], atol=1e-3)
