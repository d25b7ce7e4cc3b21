"""Forwards attend over the cache slots written so far (transformer.attended_slots), not the whole static cache:
the logits are those of attending over every slot, and the slots left out are never read; the decoders' bound on
the positions a forward feeds (verifier.RowProgress.horizon) holds when the host reads the rows' progress an
iteration late, as it does on CUDA."""
from pathlib import Path

import pytest
import torch

from fastar.model_loaders import load_ar_model
from fastar.model_loaders.drafters.small_ar import SmallARDrafter
from fastar.model_loaders.llamagen.model import LlamaGenSession
from fastar.model_loaders.shared.protocol import PromptConditioning
from fastar.samplers.token_loops import verifier
from fastar.samplers.decoders import DecoderSpec, decode
from fastar.samplers.processing import SamplingSettings
from tiny_llamagen import tiny_conditioning, tiny_model

FIXTURES = Path(__file__).resolve().parent / "conformance" / "fixtures"
PROMPTS = PromptConditioning(["a red ring on a blue background", "a green square"])
WINDOW = 5


def llamagen(model_type):
    model = tiny_model(model_type, n_kv_head=2)
    return model, tiny_conditioning(model)


def folder(name):
    return load_ar_model(FIXTURES / name, device="cpu", dtype=torch.float32), PROMPTS


MODELS = {"llamagen-c2i": lambda: llamagen("c2i"), "llamagen-t2i": lambda: llamagen("t2i"),
          "lumina-mgpt (row ends)": lambda: folder("lumina_mgpt"), "anole": lambda: folder("anole"),
          "janus": lambda: folder("janus_deepseek")}


def forward_with_the_rest_poisoned(session, window, start, keys: torch.Tensor):
    """``session.forward`` with NaN in every cache slot a forward over ``keys`` must not read (one read, even a
    masked one, makes its logits NaN); zeros there after it, as in a cache those slots were never written to."""
    for value in (float("nan"), 0.0):
        for cache in session.caches:
            cache.k[:, :, len(keys):] = value
            cache.v[:, :, len(keys):] = value
        if value != 0.0:
            out = session.forward(window, start, keys)
    return out


@pytest.mark.parametrize("name", MODELS)
def test_forwards_over_the_written_slots_give_the_whole_caches_logits_and_read_nothing_else(name):
    """Rows advance by different amounts (junk after each accepted run, overwritten by the next window), and a
    window runs past the image's end; with the slots past each forward's bound poisoned, every output that
    predicts an image token equals the one of a twin session attending over its whole cache."""
    model, rows = MODELS[name]()
    N = model.grid[0] * model.grid[1]
    part, whole = (model.start(rows, cfg=True, max_window=WINDOW) for _ in range(2))
    junk = torch.Generator().manual_seed(3)
    done, lengths = [0, 0], set()
    while min(done) < N - 1:
        window = torch.randint(0, model.vocab_size, (2, WINDOW), generator=junk)
        start = torch.tensor(done)
        keys = part.key_slots(max(done) + WINDOW)
        lengths.add(len(keys))
        got, want = forward_with_the_rest_poisoned(part, window, start, keys), whole.forward(window, start)
        for b in range(2):
            kept = N - 1 - done[b] if done[b] + WINDOW > N - 1 else WINDOW  # outputs predicting image tokens
            for side in ("cond", "uncond"):
                torch.testing.assert_close(getattr(got, side)[b, :kept], getattr(want, side)[b, :kept],
                                           atol=1e-5, rtol=1e-5)
            done[b] = min(N - 1, done[b] + int(torch.randint(1, WINDOW + 1, (), generator=junk)))
    assert len(lengths) >= 3 and min(lengths) < part.slot_index.numel(), sorted(lengths)


SAMPLING = SamplingSettings(cfg_scale=2.0, temperature=0.9, top_k=20)
SPECS = [DecoderSpec("sjd", window=4), DecoderSpec("gsd", window=6, group=3), DecoderSpec("spec", gamma=3)]


@pytest.mark.parametrize("lag", [0, 1])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.decoder)
def test_a_decoders_bound_covers_every_position_its_forwards_feed(spec, lag, monkeypatch):
    """Each target forward feeds only positions below the bound it asked ``key_slots`` for, with the rows'
    progress read at once (the CPU) or an iteration late (CUDA); the bound is no looser than the unread
    iteration allows (a window's width for it)."""
    monkeypatch.setitem(verifier.LAG_BY_DEVICE, "cpu", lag)
    fed, real_key_slots, real_forward = [], LlamaGenSession.key_slots, LlamaGenSession.forward

    def key_slots(session, horizon):
        session.asked = horizon
        return real_key_slots(session, horizon)

    def forward(session, tokens, start, keys=None):
        if keys is not None:
            fed.append((int(start.max()) + tokens.shape[1] - 1, session.asked, tokens.shape[1]))
            session.asked = None
        return real_forward(session, tokens, start, keys)

    monkeypatch.setattr(LlamaGenSession, "key_slots", key_slots)
    monkeypatch.setattr(LlamaGenSession, "forward", forward)
    model = tiny_model(seed=3)
    drafter = {"drafter": SmallARDrafter(tiny_model(seed=4))} if spec.decoder == "spec" else {}
    _, stats = decode(model, tiny_conditioning(model), SAMPLING, spec, seed=0, **drafter)
    assert len(fed) == stats.target_forwards > 4  # the drafter's steps ask no bound
    assert all(last < bound <= last + 1 + lag * width for last, bound, width in fed), fed
