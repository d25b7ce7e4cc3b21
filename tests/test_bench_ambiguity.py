"""The bench's ambiguity measures: the teacher-forced distributions are the ones plain AR samples from, position
by position (so a shifted window or a missing CFG shows), and the first-draft share counts what it says."""
import math

import pytest
import torch

from fastar.commands.bench.ambiguity import first_draft_acceptance, next_token_ambiguity
from fastar.samplers.processing import SamplingSettings, probabilities

from tiny_llamagen import tiny_conditioning, tiny_model, tiny_tokens


def stepwise(model, conditioning, sampling, codes):
    """The reference: one forward per token, as plain AR runs."""
    B, N = codes.shape
    session = model.start(conditioning, cfg=sampling.use_cfg, max_window=1)
    dists = [probabilities(session.first, sampling)[:, 0]]
    for j in range(N - 1):
        out = session.forward(codes[:, j : j + 1], torch.full((B,), j, dtype=torch.long))
        dists.append(probabilities(out, sampling)[:, 0])
    p = torch.stack(dists, dim=1).float()
    return p.amax(-1).mean(1), -(p * p.clamp_min(1e-30).log()).sum(-1).mean(1)


@pytest.mark.parametrize("model_type", ["c2i", "t2i"])
@pytest.mark.parametrize("sampling", [SamplingSettings(cfg_scale=2.0), SamplingSettings(cfg_scale=1.0, temperature=0.7),
                                      SamplingSettings(cfg_scale=3.0, top_k=8, top_p=0.9)], ids=["cfg", "no-cfg", "top-k-p"])
def test_ambiguity_is_measured_on_the_distributions_ar_samples_from(model_type, sampling):
    model = tiny_model(model_type)
    conditioning, codes = tiny_conditioning(model), tiny_tokens(model)
    measured = next_token_ambiguity(model, conditioning, sampling, codes)
    top1, entropy = stepwise(model, conditioning, sampling, codes)
    assert measured["top1_probability"] == pytest.approx(top1.tolist(), abs=1e-5)
    assert measured["entropy_nats"] == pytest.approx(entropy.tolist(), abs=1e-4)
    assert all(0 < e <= math.log(model.vocab_size) + 1e-4 for e in measured["entropy_nats"])


def test_a_shifted_sample_reads_as_another_ambiguity():
    """Sensitivity: the same measure on the sample shifted by one token differs (the check above could fail)."""
    model, sampling = tiny_model(), SamplingSettings(cfg_scale=2.0)
    conditioning, codes = tiny_conditioning(model), tiny_tokens(model)
    top1, _ = stepwise(model, conditioning, sampling, codes)
    shifted = next_token_ambiguity(model, conditioning, sampling, codes.roll(1, dims=1))
    assert shifted["top1_probability"] != pytest.approx(top1.tolist(), abs=1e-3)


def test_first_draft_acceptance_counts_iterations_that_kept_a_draft():
    assert first_draft_acceptance([1, 1, 1, 1]) == 0.0  # plain AR, or every first draft rejected
    assert first_draft_acceptance([3, 1, 2, 1]) == 0.5
    assert first_draft_acceptance([]) == 0.0
