"""Compiled steps (model_loaders/compiled.py): a model whose session steps run through torch.compile gives the
same tokens as eager for the same seed (ar, sjd with a window wider and narrower than a row, spec with a drafter;
CFG, temperature, top-k and top-p; batch 2), its logits match eager's, and only token models take the switch."""
import pytest
import torch

from fastar.errors import FastARError
from fastar.model_loaders.ar_drafter import SmallARDrafter
from fastar.model_loaders.compiled import compile_steps
from fastar.samplers.decoders import DecoderSpec, decode
from fastar.samplers.processing import SamplingSettings
from tiny_llamagen import tiny_conditioning, tiny_model
from test_mar import tiny_mar

SAMPLING = SamplingSettings(cfg_scale=2.0, temperature=0.9, top_k=20, top_p=0.95)
SPECS = [DecoderSpec("ar"), DecoderSpec("sjd", window=3), DecoderSpec("sjd", window=7, coupling="maximal")]


@pytest.fixture(scope="module")
def models():
    return tiny_model(seed=3), compile_steps(tiny_model(seed=3))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.decoder}-{s.window}")
def test_compiled_steps_give_eagers_tokens(models, spec):
    eager, compiled = models
    for seed in (0, 1):
        want, _ = decode(eager, tiny_conditioning(eager), SAMPLING, spec, seed=seed)
        got, stats = decode(compiled, tiny_conditioning(compiled), SAMPLING, spec, seed=seed)
        assert torch.equal(got, want)
    assert stats.target_forwards > 0


def test_a_drafter_chain_runs_on_compiled_steps(models):
    eager, compiled = models
    drafter = SmallARDrafter(tiny_model(seed=4))  # a model of the same family: here another random one
    spec = DecoderSpec("spec", gamma=3)
    want, _ = decode(eager, tiny_conditioning(eager), SAMPLING, spec, seed=2, drafter=drafter)
    got, _ = decode(compiled, tiny_conditioning(compiled), SAMPLING, spec, seed=2, drafter=drafter)
    assert torch.equal(got, want)


def test_compiled_logits_match_eager(models):
    eager, compiled = models
    outputs = []
    for model in models:
        session = model.start(tiny_conditioning(model), cfg=True, max_window=4)
        outputs.append(session.forward(torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]), torch.tensor([2, 5])))
    assert torch.allclose(outputs[0].cond, outputs[1].cond, atol=1e-5)
    assert torch.allclose(outputs[0].uncond, outputs[1].uncond, atol=1e-5)
    assert compiled.compiled_mode == "default" and not hasattr(eager, "compiled_mode")


def test_only_token_models_take_compiled_steps():
    with pytest.raises(FastARError, match="compiled steps are for token models.*this is a MAR model"):
        compile_steps(tiny_mar(0))


def test_the_switch_at_load_time():
    from fastar.model_loaders.demo import DEMO_KL, DEMO_MAR
    from fastar.pipeline import load_models

    assert load_models(None, None, "cpu", compiled=True).ar.compiled_mode == "default"
    assert not hasattr(load_models(None, None, "cpu").ar, "compiled_mode")
    with pytest.raises(FastARError, match="compiled steps are for token models"):
        load_models(str(DEMO_MAR), str(DEMO_KL), "cpu", compiled=True)
