"""transformers' Chameleon ``generate``, the baseline ``profile --baselines`` times FastAR's ``ar`` against on
Chameleon-family shapes, does the same work on the same weights: greedy, it draws the very codes of FastAR's ``ar``,
in Lumina-mGPT's layout (size tokens, a row end after every row, CFG's unconditional rows from boi) and in
Anole's (no row tokens, unconditional rows bos, boi), prompts of different lengths left-padded in one batch."""
import random

import pytest
import torch

from fastar.errors import FastARError
from fastar.model_loaders.chameleon.model import ChameleonConfig, ChameleonGPT
from fastar.model_loaders.shared.protocol import PromptConditioning
from fastar.samplers.processing import SamplingSettings
from fastar.samplers.token_loops.jacobi import ar_decode
from fastar.commands.profile.common import randomise
from fastar.commands.profile.loop_baselines import baseline_loops
from fastar.commands.profile.speed import build, conditioning

pytest.importorskip("transformers")

GREEDY = SamplingSettings(cfg_scale=3.0, temperature=0.0)
PROMPTS = PromptConditioning(["a photo", "a photo of a red fox"])


class WordPrompts:
    """Stands in for a tokenizer: bos, then one id per word (prompts of different lengths)."""

    def encode(self, conditioning):
        return [[1, *range(40, 40 + len(p.split()))] for p in conditioning.prompts]


def anole_tiny(qk_norm_rows=None, swin_norm=False) -> ChameleonGPT:
    """Anole's layout on a tiny random model: no size or row tokens, CFG's unconditional rows bos, boi; image codes
    in a shuffled order of the vocabulary, grouped-query attention."""
    image_ids = list(range(300, 812))
    random.Random(0).shuffle(image_ids)
    cfg = ChameleonConfig(hidden_size=64, n_layer=2, n_head=4, n_kv_head=2, ffn_hidden=96, vocab_size=1024,
                          image_ids=image_ids, boi=8, eoi=9, grid=(4, 4), bos=1, uncond_bos=True,
                          qk_norm_rows=qk_norm_rows, swin_norm=swin_norm)
    model = ChameleonGPT(cfg, prompts=WordPrompts())
    randomise(model, 0)
    with torch.no_grad():  # QK-norm affines far from the identity: a row given to the wrong head changes the codes
        for name, p in model.named_parameters():
            if "_norm." in name:
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.5)
    model.keep_image_rows()  # as the loader leaves it
    return model.eval()


def fastar_ar(model, prompts, sampling=GREEDY):
    return ar_decode(model, prompts, sampling, generator=torch.Generator().manual_seed(0))[0]


def transformers_generate(model):
    loops = baseline_loops(model)
    assert list(loops) == ["transformers generate()"]
    return loops["transformers generate()"]


def test_lumina_tiny_row_end_layout_draws_fastar_ar_codes():
    model = build("lumina-tiny", torch.device("cpu"), torch.float32)
    loop = transformers_generate(model)
    profiled = conditioning(model, 2)  # the profile's own prompts
    codes = loop(profiled, GREEDY, torch.Generator().manual_seed(0))
    assert codes.shape == (2, 16) and torch.equal(codes, fastar_ar(model, profiled))
    model.prompts = WordPrompts()
    assert torch.equal(loop(PROMPTS, GREEDY, torch.Generator()), fastar_ar(model, PROMPTS))


@pytest.mark.parametrize("qk_norm_rows, swin_norm", [(None, False), ((2, 1), False), (None, True)],
                         ids=["qk-norm-per-head", "qk-norm-per-shard", "swin-norm"])
def test_anole_layout_draws_fastar_ar_codes(qk_norm_rows, swin_norm):
    model = anole_tiny(qk_norm_rows, swin_norm)
    codes = transformers_generate(model)(PROMPTS, GREEDY, torch.Generator())
    assert codes.shape == (2, 16) and torch.equal(codes, fastar_ar(model, PROMPTS))


def test_without_cfg_sampled_and_the_filters_it_refuses():
    model = anole_tiny()
    loop = transformers_generate(model)
    plain = SamplingSettings(cfg_scale=1.0, temperature=0.0)
    assert torch.equal(loop(PROMPTS, plain, torch.Generator()), fastar_ar(model, PROMPTS, plain))
    sampled = loop(PROMPTS, SamplingSettings(cfg_scale=3.0), torch.Generator().manual_seed(1))  # the profile's
    assert sampled.shape == (2, 16) and 0 <= sampled.min() and sampled.max() < 512
    for filtered in (SamplingSettings(top_k=5), SamplingSettings(top_p=0.9)):
        with pytest.raises(FastARError, match="without top-k or top-p"):
            loop(PROMPTS, filtered, torch.Generator())
