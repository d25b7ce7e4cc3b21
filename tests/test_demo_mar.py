"""The bundled demo MAR and its draft behave as a user is told: samples the judge recognises, a draft the
target accepts often (and itself all but always), and CSpD that needs fewer target calls than plain MAR."""
import pytest
import torch

from fastar.model_loaders import load_ar_model, load_image_decoder
from fastar.model_loaders.demo import DEMO_KL, DEMO_MAR, DEMO_MAR_DRAFT
from fastar.model_loaders.drafters import load_drafter
from fastar.model_loaders.protocol import ClassConditioning
from fastar.pipeline import outputs_to_images
from fastar.samplers.cspd import CSpDSettings
from fastar.samplers.decoders import decode_masked
from fastar.samplers.masked import MaskedSettings

pytestmark = pytest.mark.skipif(not (DEMO_MAR.exists() and DEMO_MAR_DRAFT.exists() and DEMO_KL.exists()),
                                reason="the demo MAR files are not bundled in this checkout")

SETTINGS = MaskedSettings(num_iter=32, cfg_scale=3.0, diffusion_steps=50)
EVERY_CLASS = ClassConditioning(torch.arange(8))


@pytest.fixture(scope="module")
def target():
    return load_ar_model(DEMO_MAR)


def cspd(target, drafter, verify="steps"):
    return decode_masked(target, EVERY_CLASS, SETTINGS, "cspd", seed=0, drafter=drafter,
                         cspd=CSpDSettings(verify=verify))


def test_plain_mar_samples_show_the_requested_class(target):
    from fastar.tools.classifier import classify, load_classifier

    tokens, stats = decode_masked(target, EVERY_CLASS, SETTINGS, "ar", seed=0)
    assert stats.target_forwards == 32 and tokens.abs().max() < 20  # no blown-up first reverse step
    images = outputs_to_images(load_image_decoder(DEMO_KL), target, tokens)
    predicted, _ = classify(load_classifier(), images)
    assert int((predicted == torch.arange(8)).sum()) >= 6, predicted


def test_the_target_drafting_for_itself_is_always_accepted(target):
    _, stats = cspd(target, load_drafter(DEMO_MAR, target))
    # not always 100%: the target scores a round's steps in one batched call and the draft one by one, and the
    # first reverse step amplifies that float rounding (a first demo target, blown up, still accepted 99.2%)
    assert stats.accepted_tokens >= 0.99 * stats.drafted_tokens > 0


@pytest.mark.parametrize("verify", ["steps", "merged"])
def test_the_demo_draft_saves_target_calls(target, verify):
    _, stats = cspd(target, load_drafter(DEMO_MAR_DRAFT, target), verify)
    assert stats.accepted_tokens > 0.3 * stats.drafted_tokens
    assert stats.target_forwards < 32 and stats.drafter_forwards > 0
