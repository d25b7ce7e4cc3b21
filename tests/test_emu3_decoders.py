"""Every token decoder on Emu3 (the conformance fixture in transformers' layout, loaded as a user loads it), across
its row ends: batch 2, CFG 3 against the negative prompt, a temperature, top-k and top-p, on a grid wider than the
window and one narrower; the statistics by their one definition (test_stats_invariants.py) and no code out of
range. Greedy Jacobi decoders write greedy AR's codes exactly across the row ends; in bf16 and fp16 (emulated on the
CPU) ar and sjd still run and agree with fp32 where the distribution is not near a tie."""
import pytest
import torch

from fastar.pipeline import conditioning_for, load_models
from fastar.samplers.decoders import DecoderSpec, decode
from fastar.samplers.processing import SamplingSettings
from fastar.samplers.token_loops.drafts import COUPLINGS, INIT_STRATEGIES
from fastar.tests.conformance.common import fixture
from test_stats_invariants import check_invariants

SAMPLING = SamplingSettings(cfg_scale=3.0, temperature=0.9, top_k=40, top_p=0.95)
GREEDY = SamplingSettings(cfg_scale=3.0, temperature=0.0)
PROMPTS = ["a red apple on a table", "a dog"]
NEGATIVE = ["blurry, low quality"]
GRID = (4, 6)  # image size 40 at 5:4: rows of 6 tokens, so window 3 sits inside a row and window 8 crosses one


@pytest.fixture(scope="module")
def emu3():
    folder = str(fixture("emu3_hf"))  # --vq: the model folder itself, which holds its decoder
    models = load_models(folder, folder, "cpu", "fp32", image_size=40, aspect_ratio="5:4")
    assert models.ar.grid == GRID
    return models


def conditioning(model, negative=True):
    return conditioning_for(model, prompts=PROMPTS, negative_prompts=NEGATIVE if negative else None)


def run(models, spec: DecoderSpec, sampling=SAMPLING, seed=1, drafter=None, negative=True):
    codes, stats = decode(models.ar, conditioning(models.ar, negative), sampling, spec, seed=seed, drafter=drafter,
                          codebook=models.codebook())
    assert codes.shape == (2, GRID[0] * GRID[1])
    assert int(codes.min()) >= 0 and int(codes.max()) < models.ar.vocab_size == models.vq.cfg.codebook_size
    return codes, stats


DECODERS = [DecoderSpec("ar"),
            *(DecoderSpec("sjd", coupling=c) for c in COUPLINGS),
            *(DecoderSpec("sjd", init=i) for i in INIT_STRATEGIES),
            DecoderSpec("sjd-pac"), DecoderSpec("sjd-entropy"), DecoderSpec("gsd", group=3),
            DecoderSpec("zipar", zipar_lead=2), DecoderSpec("zipar-sjd", zipar_lead=2), DecoderSpec("lantern"),
            DecoderSpec("lantern", lantern_lambda=2.0), DecoderSpec("fm", flow_steps=4)]


def windowed(spec: DecoderSpec, window: int) -> DecoderSpec:
    """``spec`` at ``window``; SJD-PAC's branched tree 2 deep in a narrow window (its own check: 2 x 2 needs 4)."""
    if spec.decoder == "sjd-pac" and window < 8:
        return DecoderSpec(**{**spec.as_dict(), "window": max(window, 4), "pac_depth": 2})
    return DecoderSpec(**{**spec.as_dict(), "window": window})


def spec_id(spec: DecoderSpec) -> str:
    return "-".join([spec.decoder, spec.coupling, spec.init, *(["lambda"] if spec.lantern_lambda else [])])


@pytest.mark.parametrize("window", [3, 8])
@pytest.mark.parametrize("spec", DECODERS, ids=spec_id)
def test_every_decoder_across_row_ends(emu3, spec, window):
    spec = windowed(spec, window)
    _, stats = run(emu3, spec)
    check_invariants(stats, spec.decoder)
    assert stats.baseline_forwards == GRID[0] * GRID[1] - 1 or spec.decoder == "fm"


@pytest.fixture(scope="module")
def greedy_ar(emu3):
    return run(emu3, DecoderSpec("ar"), GREEDY)[0]


@pytest.mark.parametrize("window", [3, 8])
@pytest.mark.parametrize("decoder", ["sjd", "sjd-pac", "zipar-sjd"])
def test_greedy_jacobi_decoders_write_greedy_ars_codes(emu3, greedy_ar, decoder, window):
    """A lead of the whole row makes ZipAR's schedule plain AR's (a shorter lead samples ZipAR's own law: below)."""
    spec = windowed(DecoderSpec(decoder, zipar_lead=GRID[1]), window)
    codes, _ = run(emu3, spec, GREEDY, seed=7)
    assert torch.equal(codes, greedy_ar)


@pytest.mark.parametrize("window", [3, 8])
def test_greedy_zipar_sjd_writes_greedy_zipars_codes(emu3, greedy_ar, window):
    """With a lead below the width, rows start before the row above ends: the windows keep ZipAR's codes exactly."""
    zipar, _ = run(emu3, DecoderSpec("zipar", zipar_lead=2), GREEDY)
    codes, stats = run(emu3, DecoderSpec("zipar-sjd", window=window, zipar_lead=2), GREEDY, seed=7)
    assert torch.equal(codes, zipar) and not torch.equal(codes, greedy_ar)
    assert stats.accepted_tokens > 0


def test_the_negative_prompt_guides(emu3, greedy_ar):
    """The default negative prompt (BAAI's) and the one given guide differently: the rows are built from them."""
    default, _ = run(emu3, DecoderSpec("ar"), GREEDY, negative=False)
    assert not torch.equal(default, greedy_ar)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("decoder", ["ar", "sjd"])
def test_half_precision(emu3, dtype, decoder):
    """A GPU user's ``auto`` dtype, emulated on the CPU: every decoder step runs in half precision, the logits the
    sampler reads are fp32, finite and within half precision's rounding of fp32's, and the codes are in range (the
    same invariants as fp32)."""
    folder = str(fixture("emu3_hf"))
    models = load_models(folder, folder, "cpu", {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype],
                         image_size=40, aspect_ratio="5:4")
    assert models.ar.dtype == dtype
    first = models.ar.start(conditioning(models.ar), cfg=True, max_window=8).first
    assert first.cond.dtype == torch.float32 and torch.isfinite(first.cond).all()
    full = emu3.ar.start(conditioning(emu3.ar), cfg=True, max_window=8).first
    tolerance = {torch.bfloat16: 0.1, torch.float16: 0.01}[dtype] * full.cond.std()  # half precision's rounding
    assert (first.cond - full.cond).abs().max() <= tolerance and (first.uncond - full.uncond).abs().max() <= tolerance
    _, stats = run(models, DecoderSpec(decoder, window=8))
    check_invariants(stats, decoder)
