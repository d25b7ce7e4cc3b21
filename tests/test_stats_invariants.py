"""Every decoder on every family reports its statistics by one definition per field (docs/statistics.md): the
tokens each forward fixed add up to the image, the forward that fixed each token agrees with them, step
compression is tokens over forwards, drafts are counted where they are judged, and the JSON says what the
properties say. Run on the bundled demo models (and a tiny Janus-Pro), batch 2 with guidance."""
import json
from collections import Counter

import pytest
import torch

from fastar.model_loaders import load_ar_model
from fastar.model_loaders.drafters.loader import load_drafter
from fastar.model_loaders.shared.demo import DEMO_AR, DEMO_DD, DEMO_MAR, DEMO_TEXT, DEMO_VAR, DEMO_VAR_DD
from fastar.model_loaders.shared.protocol import ClassConditioning, PromptConditioning
from fastar.pipeline import load_models
from fastar.samplers.decoders import (DecoderSpec, decode, decode_distilled, decode_masked, decode_next_scale)
from fastar.samplers.few_step_loops.distilled import DDSettings
from fastar.samplers.masked_loops.cspd import CSpDSettings
from fastar.samplers.masked_loops.feature_reuse import FeatureReuse
from fastar.samplers.masked_loops.masked import MaskedSettings
from fastar.samplers.processing import SamplingSettings

SAMPLING = SamplingSettings(cfg_scale=2.0, top_k=50)
DRAFTING = {"sjd", "sjd-pac", "sjd-entropy", "gsd", "spec", "lantern", "zipar-sjd", "cspd", "cspd-relaxed"}
ONE_WINDOW_PER_IMAGE = {"sjd", "sjd-pac", "sjd-entropy", "gsd", "spec", "lantern"}  # one verified window per image and forward


@pytest.fixture(scope="module")
def class_demo():
    return load_models(str(DEMO_AR), None, "cpu", drafter_path="demo")


def check_invariants(stats, decoder: str) -> None:
    B, N, F = stats.batch, stats.tokens, stats.target_forwards
    assert len(stats.fixed_at) == B and all(len(row) == N for row in stats.fixed_at)
    assert stats.step_compression == pytest.approx(N / F)
    assert len(stats.fixed_per_forward) == F and all(len(counts) == B for counts in stats.fixed_per_forward)
    for image, row in enumerate(stats.fixed_at):
        by_forward = Counter(row)
        assert set(by_forward) <= set(range(F + 1))
        column = [counts[image] for counts in stats.fixed_per_forward]
        assert [by_forward.get(f, 0) for f in range(1, F + 1)] == column  # fixed_at agrees with the counts
        assert by_forward.get(0, 0) + sum(column) == N  # every token fixed once: by the prefill or a forward
        assert stats.row_forwards[image] == max(f for f, n in enumerate(column, 1) if n) <= F
    fixed = sum(map(sum, stats.fixed_per_forward))
    assert stats.tokens_per_forward == pytest.approx(fixed / sum(stats.row_forwards))
    assert stats.baseline and stats.baseline_forwards > 0
    assert stats.steps_saved == pytest.approx(stats.baseline_forwards / F)
    assert 0 <= stats.accepted_tokens <= stats.drafted_tokens
    assert (stats.acceptance_rate is None) == (stats.drafted_tokens == 0)
    assert (stats.drafted_tokens > 0) == (decoder in DRAFTING), stats.drafted_tokens
    if decoder in ONE_WINDOW_PER_IMAGE:  # a forward fixes its kept drafts plus one token, but maybe the last
        assert sum(stats.row_forwards) - B <= fixed - stats.accepted_tokens <= sum(stats.row_forwards)
    if decoder == "zipar-sjd":  # one token at least per running image row and forward besides the kept drafts
        assert fixed - stats.accepted_tokens >= sum(stats.row_forwards)
    data = json.loads(json.dumps(stats.to_json()))
    for name in ("tokens", "target_forwards", "baseline_forwards", "row_forwards", "drafted_tokens",
                 "accepted_tokens", "fixed_per_forward", "fixed_at"):
        assert data[name] == getattr(stats, name), name
    for name in ("step_compression", "row_step_compression", "tokens_per_forward", "acceptance_rate"):
        assert data[name] == pytest.approx(getattr(stats, name)), name
    summary = stats.steps_summary()
    assert summary.startswith(f"{B} images of {N} tokens in {F} forward")
    assert (f"; {stats.baseline} takes {stats.baseline_forwards}: " in summary) == (stats.baseline_forwards != F)


TOKEN_DECODERS = [("ar", False), ("sjd", False), ("sjd-pac", False), ("sjd-entropy", False), ("gsd", False),
                  ("spec", True), ("lantern", True), ("lantern", False), ("zipar", False), ("zipar-sjd", False),
                  ("fm", False)]


@pytest.mark.parametrize("decoder, drafted", TOKEN_DECODERS, ids=lambda v: str(v))
def test_the_class_demos_decoders(class_demo, decoder, drafted):
    spec = DecoderSpec(decoder, window=8, zipar_lead=4, coupling="maximal" if decoder.startswith("sjd") else "independent")
    _, stats = decode(class_demo.ar, ClassConditioning(torch.tensor([0, 5])), SAMPLING, spec, seed=1,
                      drafter=class_demo.drafter if drafted else None, codebook=class_demo.codebook())
    check_invariants(stats, decoder)
    assert stats.baseline == "plain AR" and stats.baseline_forwards == 255


@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_the_class_demos_drafter_on_trees(class_demo, tree):
    spec = DecoderSpec("spec", tree=tree, tree_depth=3, tree_topk=4, tree_nodes=12)
    _, stats = decode(class_demo.ar, ClassConditioning(torch.tensor([0, 5])), SAMPLING, spec, seed=1,
                      drafter=class_demo.drafter, codebook=class_demo.codebook())
    check_invariants(stats, "spec")
    assert stats.drafted_tokens > stats.accepted_tokens > stats.target_forwards  # siblings tried, several kept


@pytest.mark.parametrize("decoder", ["ar", "sjd", "sjd-pac", "gsd", "zipar-sjd"])
def test_the_text_demos_decoders(decoder):
    """Lumina-mGPT's layout: row-end tokens inside the windows are fed, never counted as image tokens."""
    models = load_models(str(DEMO_TEXT), None, "cpu")
    _, stats = decode(models.ar, PromptConditioning(["a red ring on a cyan background", "a blue cross on a white "
                                                     "background"]), SAMPLING, DecoderSpec(decoder, window=8),
                      seed=2, codebook=models.codebook())
    check_invariants(stats, decoder)


@pytest.mark.parametrize("spec", [DecoderSpec("sjd", window=4), DecoderSpec("sjd-pac", window=8)],
                         ids=lambda s: s.decoder)
def test_janus_pro(tmp_path, spec):
    from tiny_janus import hf_model, write_converted

    model = load_ar_model(str(write_converted(tmp_path / "janus", hf_model())), device="cpu")
    _, stats = decode(model, PromptConditioning(["a red ring", "a blue square"]), SAMPLING, spec, seed=3)
    check_invariants(stats, spec.decoder)


@pytest.fixture(scope="module")
def mar():
    target = load_ar_model(str(DEMO_MAR), device="cpu")
    return target, load_drafter("demo", target)


@pytest.mark.parametrize("decoder, reuse", [("ar", False), ("ar", True), ("cspd", False), ("cspd-relaxed", False)])
def test_mar_and_cspd(mar, decoder, reuse):
    target, draft = mar
    settings = MaskedSettings(num_iter=8, cfg_scale=3.0, diffusion_steps=5,
                              reuse=FeatureReuse(start_percent=0.2) if reuse else None)
    cspd = CSpDSettings(gamma=3, ratio_temperature=42.0 if decoder == "cspd-relaxed" else 1.0)
    _, stats = decode_masked(target, ClassConditioning(torch.tensor([0, 3])), settings, decoder, seed=4, cspd=cspd,
                             drafter=draft if decoder.startswith("cspd") else None)
    check_invariants(stats, decoder)
    assert stats.baseline_forwards == 8


@pytest.mark.parametrize("decoder", ["ar", "fm"])
def test_var(decoder):
    models = load_models(str(DEMO_VAR), None, "cpu")
    _, stats = decode_next_scale(models.ar, ClassConditioning(torch.tensor([1, 2])), SamplingSettings(cfg_scale=1.5),
                                 seed=5, vqvae=models.vq, decoder=decoder)
    check_invariants(stats, decoder)
    assert stats.tokens == models.ar.cfg.seq_len == 130 and stats.target_forwards == stats.baseline_forwards == 6
    assert stats.fixed_at[0][:5] == [1, 2, 2, 2, 2]  # the 1x1 scale, then the 2x2 one


@pytest.mark.parametrize("steps, teacher", [(1, False), (2, False), (2, True)])
def test_distilled_decoding(class_demo, steps, teacher):
    models = load_models(str(DEMO_DD), None, "cpu")
    settings = DDSettings(steps=steps)
    if teacher:
        settings = settings.hybrid(models.ar, 40)
    _, stats = decode_distilled(models.ar, ClassConditioning(torch.tensor([2, 6])), settings, seed=6,
                                codebook=models.codebook(), teacher=class_demo.ar if teacher else None,
                                sampling=SAMPLING)
    check_invariants(stats, "dd")
    assert stats.target_forwards == steps + (stats.settings["t2"] - 40 if teacher else 0)


def test_var_dd():
    models = load_models(str(DEMO_VAR_DD), None, "cpu")
    _, stats = decode_distilled(models.ar, ClassConditioning(torch.tensor([2, 6])), DDSettings(steps=2), seed=7,
                                codebook=models.codebook())
    check_invariants(stats, "dd")
    assert stats.tokens == 130 and stats.baseline_forwards == 6
