"""Host syncs per decoder (issue 31): a GPU waits for the host at each, so a decoder keeps to its budget: `ar`,
MAR and VAR a few per generation (setup and the final stats), SJD, GSD, LANTERN and drafter chains one per
iteration (the check that every row is done; on CUDA it reads the previous iteration's count, which the GPU has
finished: verifier.RowProgress), CSpD one per drafted step. Counted on the CPU by the operations
that would sync on a GPU (tests/host_syncs.py); the GPU check counts the real ones."""
import copy

import pytest
import torch

from fastar.model_loaders.drafters.small_ar import SmallARDrafter
from fastar.model_loaders.shared.protocol import ClassConditioning
from fastar.samplers.masked_loops.cspd import CSpDSettings
from fastar.samplers.decoders import DecoderSpec, decode, decode_masked, decode_next_scale
from fastar.samplers.masked_loops.feature_reuse import FeatureReuse
from fastar.samplers.masked_loops.masked import MaskedSettings
from fastar.samplers.processing import SamplingSettings
from host_syncs import HostSyncs
from test_feature_reuse import deep_mar
from test_mar import tiny_mar
from tiny_llamagen import tiny_conditioning, tiny_model
from tiny_var import tiny_var, tiny_vqvae

SAMPLING = SamplingSettings(cfg_scale=2.0, temperature=0.9, top_k=20, top_p=0.95)
PER_GENERATION = 6  # setup (the prefill's first code, a table's fingerprint) and the stats read at the end
ROWS = ClassConditioning(torch.tensor([1, 2]))


def counted(run):
    run(0)  # tables built and cached, as from the second image on
    with HostSyncs() as syncs:
        stats = run(1)
    return syncs, stats


@pytest.mark.parametrize("spec", [DecoderSpec("sjd", window=4), DecoderSpec("gsd", window=4, group=5),
                                  DecoderSpec("spec", gamma=3), DecoderSpec("lantern", gamma=3),
                                  DecoderSpec("spec", tree="static"), DecoderSpec("lantern", tree="dynamic", tree_nodes=20),
                                  DecoderSpec("zipar", zipar_lead=1), DecoderSpec("zipar-sjd", zipar_lead=1, window=3),
                                  DecoderSpec("sjd-pac", window=10, coupling="maximal"),
                                  DecoderSpec("sjd-entropy", window=4)],
                         ids=lambda s: s.decoder + ("-tree" if s.tree != "chain" else ""))
def test_token_decoders_sync_once_per_iteration(spec):
    model = tiny_model(seed=3)
    kwargs = {"drafter": SmallARDrafter(tiny_model(seed=4))} if spec.decoder in ("spec", "lantern") else {}
    if spec.decoder == "lantern":
        kwargs["codebook"] = torch.randn(model.vocab_size, 8, generator=torch.Generator().manual_seed(0))
    syncs, stats = counted(lambda seed: decode(model, tiny_conditioning(model), SAMPLING, spec, seed=seed,
                                               **kwargs)[1])
    assert stats.target_forwards > 5
    assert syncs.total <= stats.target_forwards + PER_GENERATION, dict(syncs.calls)


def test_ar_does_not_sync_per_token():
    model = tiny_model(seed=3)
    syncs, stats = counted(lambda seed: decode(model, tiny_conditioning(model), SAMPLING, DecoderSpec("ar"),
                                               seed=seed)[1])
    assert stats.target_forwards > 10 and syncs.total <= PER_GENERATION, dict(syncs.calls)


def test_mar_syncs_once_per_generation_and_cspd_once_per_drafted_step():
    target = tiny_mar(0)
    settings = MaskedSettings(num_iter=8, cfg_scale=2.5, diffusion_steps=6)
    syncs, stats = counted(lambda seed: decode_masked(target, ROWS, settings, seed=seed)[1])
    assert stats.target_forwards == 8 and syncs.total <= PER_GENERATION, dict(syncs.calls)
    draft = copy.deepcopy(target)  # accepts every draft: no residual sampling, which syncs by nature
    syncs, stats = counted(lambda seed: decode_masked(target, ROWS, settings, "cspd", seed=seed, drafter=draft,
                                                      cspd=CSpDSettings(gamma=3))[1])
    assert stats.drafter_forwards > 3 and stats.accepted_tokens == stats.drafted_tokens
    assert syncs.total <= stats.drafter_forwards + PER_GENERATION, dict(syncs.calls)


def test_mar_with_feature_reuse_syncs_once_per_generation():
    settings = MaskedSettings(num_iter=8, cfg_scale=2.5, diffusion_steps=6,
                              reuse=FeatureReuse(start_percent=0.25, refresh_every=3, head_refresh_every=2))
    model = deep_mar()
    syncs, stats = counted(lambda seed: decode_masked(model, ROWS, settings, seed=seed)[1])
    assert stats.transformer_work < 1 and syncs.total <= PER_GENERATION, dict(syncs.calls)


def test_var_syncs_per_generation_not_per_scale():
    model, vqvae = tiny_var(), tiny_vqvae()
    syncs, _ = counted(lambda seed: decode_next_scale(model, ROWS, SAMPLING, seed=seed, vqvae=vqvae)[1])
    assert syncs.total <= PER_GENERATION, dict(syncs.calls)
