"""ZipAR: what it samples, proven on enumerable toys; its feeds on the real families' attention.

ZipAR (samplers/token_loops/zipar.py, as the reference code schedules it) samples the first row, then the second, then starts
each later row once the row above has ``lead`` tokens, one token per running row and forward. Token (r, c) is drawn
from the model given what that schedule has fixed before it (in raster order); a row's first token is predicted
from a stand-in in the last slot of the row above: the newest token of the row two above. The toy reads a hidden
position as code 0, so the exact law of ZipAR is computable by enumeration; it is written here from that
definition, not from the sampler's code. With the exact rule, Jacobi drafts inside the rows (zipar-sjd) must
sample that same law; lead >= width is plain AR.
"""
import pytest
import torch

from fastar.model_loaders.shared.protocol import ClassConditioning
from fastar.samplers.token_loops import zipar
from fastar.samplers.decoders import DecoderSpec, decode
from fastar.samplers.processing import SamplingSettings
from fastar.samplers.token_loops.zipar import zipar_context, zipar_decode
from fastar.commands.bench.toy_model import ToyModel

from test_exact_distribution import ALPHA, chi_square_p_value

ROWS = 20000
TOYS = {grid: ToyModel(vocab=3, grid=grid, num_classes=2, scale=2.0, seed=5) for grid in ((3, 2), (3, 3))}
GUIDED = SamplingSettings(cfg_scale=2.0)
OTHERS = {"T0.7-topk2": SamplingSettings(cfg_scale=2.0, temperature=0.7, top_k=2),
          "T1.3-topp0.8": SamplingSettings(cfg_scale=1.5, temperature=1.3, top_p=0.8)}


def schedule_time(pos, w, lead):
    """The iteration at which plain ZipAR fixes raster position ``pos``."""
    r, c = divmod(pos, w)
    return c if r == 0 else w + (r - 1) * min(lead, w) + c


def forwards(grid, lead):
    h, w = grid
    return schedule_time(h * w - 1, w, lead)


def zipar_view(grid, lead):
    """What position ``pos`` is drawn from under ZipAR, for the toy: hidden positions read 0, and a row's first
    token (from the third row on, with a lead below the width) sees the stand-in in the last slot of the row
    above."""
    w = grid[1]
    lead = min(lead, w)

    def view(seq, pos):
        seen = [seq[j] if schedule_time(j, w, lead) < schedule_time(pos, w, lead) else 0 for j in range(pos)]
        r, c = divmod(pos, w)
        if c == 0 and r >= 2 and lead < w:
            newest = w if r == 2 else min(w, 2 * lead)
            seen[pos - 1] = seq[(r - 2) * w + newest - 1]
        return seen

    return view


def draw(model, settings, **kwargs):
    cond = ClassConditioning(torch.full((ROWS,), 1, dtype=torch.long))
    return zipar_decode(model, cond, settings, generator=torch.Generator().manual_seed(11), **kwargs)


def exact_zipar(model, settings, lead):
    return model.exact_joint(1, cfg_scale=settings.cfg_scale, temperature=settings.temperature, top_k=settings.top_k,
                             top_p=settings.top_p, view=zipar_view(model.grid, lead))


@pytest.mark.parametrize("grid, lead", [((3, 2), 1), ((3, 3), 1), ((3, 3), 2)])
def test_zipar_samples_its_context_law(grid, lead):
    model = TOYS[grid]
    tokens, stats = draw(model, GUIDED, lead=lead)
    assert stats.target_forwards == forwards(grid, lead)  # one token per running row per forward
    assert chi_square_p_value(tokens, exact_zipar(model, GUIDED, lead), model) > ALPHA
    # it is a relaxation: plain AR's law is another one
    assert chi_square_p_value(tokens, model.exact_joint(1, cfg_scale=2.0), model) < ALPHA


def test_a_lead_of_the_whole_row_is_plain_ar():
    model = TOYS[(3, 3)]
    tokens, stats = draw(model, GUIDED, lead=3)
    assert stats.target_forwards == 8
    assert chi_square_p_value(tokens, model.exact_joint(1, cfg_scale=2.0), model) > ALPHA


@pytest.mark.parametrize("lead, window, coupling", [(1, 2, "independent"), (1, 3, "maximal"), (2, 3, "independent"),
                                                    (1, 4, "gumbel")])
def test_jacobi_drafts_inside_rows_keep_zipar_law(lead, window, coupling):
    model = TOYS[(3, 3)]
    tokens, stats = draw(model, GUIDED, lead=lead, window=window, coupling=coupling)
    assert stats.target_forwards <= forwards((3, 3), lead)
    assert chi_square_p_value(tokens, exact_zipar(model, GUIDED, lead), model) > ALPHA


@pytest.mark.parametrize("name", OTHERS)
def test_zipar_sjd_is_exact_under_temperature_top_k_and_top_p(name):
    model, settings = TOYS[(3, 2)], OTHERS[name]
    tokens, _ = draw(model, settings, lead=1, window=3)
    assert chi_square_p_value(tokens, exact_zipar(model, settings, 1), model) > ALPHA


def test_a_wider_context_than_zipar_fixed_is_detected(monkeypatch):
    """Broken on purpose: feeds that see one column more of the rows above than K allows sample another law."""
    model = TOYS[(3, 3)]
    real = zipar.zipar_context
    monkeypatch.setattr(zipar, "zipar_context", lambda rows, cols, grid, lead: real(rows, cols, grid, lead + 1))
    tokens, _ = draw(model, GUIDED, lead=1, window=2)
    assert chi_square_p_value(tokens, exact_zipar(model, GUIDED, 1), model) < ALPHA


def test_untempered_draft_distributions_are_detected(monkeypatch):
    """Broken on purpose: carried drafts recorded with a q that is not the one they were drawn from."""
    model = TOYS[(3, 3)]
    real = zipar.DraftSource.refine

    def biased(self, p, x, q, positions, noise=None, has_draft=None):
        return real(self, (p ** 0.3) / (p ** 0.3).sum(-1, keepdim=True), x, q, positions, noise, has_draft)

    monkeypatch.setattr(zipar.DraftSource, "refine", biased)
    tokens, _ = draw(model, GUIDED, lead=1, window=3)
    assert chi_square_p_value(tokens, exact_zipar(model, GUIDED, 1), model) < ALPHA


def test_context_mask_matches_its_definition():
    grid, lead = (4, 5), 2
    rows, cols = torch.tensor([2, 3, 1]), torch.tensor([1, 0, 5])
    mask = zipar_context(rows, cols, grid, lead)
    for i, (r, c) in enumerate(zip(rows.tolist(), cols.tolist())):
        expected = ({(0, cc) for cc in range(5)} if r else set()) | {(r, cc) for cc in range(c)} | \
            {(rr, cc) for rr in range(1, r) for cc in range(min(5, c + (r - rr) * lead))}  # the first row: whole
        assert {divmod(j, 5) for j in mask[i].nonzero().flatten().tolist()} == expected


# -- the real families' attention: the feeds see exactly what they are given -------------------------------------
PROMPTS = ["a red ring on a blue background", "a green square"]
GREEDY = SamplingSettings(cfg_scale=2.0, temperature=0.0)


@pytest.fixture(scope="module", params=["llamagen", "lumina", "janus"])
def family(request, tmp_path_factory):
    """A tiny model of each attention layout (LlamaGen's 2-D RoPE; Lumina-mGPT's row ends; Janus without them) and
    two rows of its conditioning."""
    from fastar.model_loaders import load_ar_model
    from fastar.model_loaders.shared.protocol import PromptConditioning

    if request.param == "llamagen":
        from fastar.tests.tiny_llamagen import tiny_conditioning, tiny_model

        model = tiny_model()
        return model, tiny_conditioning(model)
    folder = tmp_path_factory.mktemp(request.param) / f"tiny-{request.param}"
    if request.param == "lumina":
        from fastar.tests.tiny_chameleon import hf_model, write_folder

        write_folder(folder, hf_model(seed=0), lumina=True, image_size=128)
    else:
        from fastar.tests.tiny_janus import hf_model, write_converted

        write_converted(folder, hf_model(seed=0))
    return load_ar_model(folder), PromptConditioning(PROMPTS)


def greedy(model, conditioning, spec):
    return decode(model, conditioning, GREEDY, spec, seed=0)


def test_a_lead_of_the_whole_row_gives_plain_ar_tokens(family):
    model, conditioning = family
    ar, _ = greedy(model, conditioning, DecoderSpec("ar"))
    tokens, stats = greedy(model, conditioning, DecoderSpec("zipar", zipar_lead=model.grid[1]))
    assert torch.equal(tokens, ar)
    assert stats.target_forwards == model.grid[0] * model.grid[1] - 1


@pytest.mark.parametrize("lead", [1, 2])
def test_drafts_inside_rows_reproduce_zipar_tokens(family, lead):
    model, conditioning = family
    plain, plain_stats = greedy(model, conditioning, DecoderSpec("zipar", zipar_lead=lead))
    drafted, stats = greedy(model, conditioning, DecoderSpec("zipar-sjd", zipar_lead=lead, window=4))
    assert torch.equal(drafted, plain)
    assert stats.target_forwards <= plain_stats.target_forwards
    h, w = model.grid
    assert plain_stats.target_forwards == forwards((h, w), lead)
    assert 0 <= int(plain.min()) and int(plain.max()) < model.vocab_size


def test_hidden_positions_change_what_a_feed_predicts(family):
    """The mask is real: ZipAR with a short lead draws other greedy tokens than plain AR on random weights."""
    model, conditioning = family
    ar, _ = greedy(model, conditioning, DecoderSpec("ar"))
    tokens, _ = greedy(model, conditioning, DecoderSpec("zipar", zipar_lead=1))
    assert not torch.equal(tokens, ar)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_the_demo_model_runs_zipar_in_half_precision_and_draws_the_class(dtype):
    """What a GPU user's ``auto`` dtype gives (emulated on the CPU): codes in range and images the judge names."""
    from fastar.commands.bench.classifier import classify, load_classifier
    from fastar.model_loaders import load_ar_model, load_image_decoder
    from fastar.model_loaders.shared.demo import DEMO_AR, DEMO_VQ
    from fastar.pipeline import decode_images

    model, vq = load_ar_model(DEMO_AR, dtype=dtype), load_image_decoder(DEMO_VQ, dtype=dtype)
    labels = torch.arange(8)
    for spec in (DecoderSpec("zipar", zipar_lead=4), DecoderSpec("zipar-sjd", zipar_lead=4, window=4)):
        codes, _ = decode(model, ClassConditioning(labels), SamplingSettings(), spec, seed=0)
        assert 0 <= int(codes.min()) and int(codes.max()) < model.vocab_size
        predicted, _ = classify(load_classifier(), decode_images(vq, model.decoder_input(codes)))
        assert (predicted == labels).float().mean() >= 0.5, (spec.decoder, predicted)


def test_the_reference_attention_is_plain_zipar_only_and_a_whole_row_lead_is_still_ar(family):
    """The reference code's view (zero-filled unfinished slots, proven against its sampler in tests/conformance):
    with a lead of the whole width nothing is unfinished, so it is plain AR too; drafts would leave stale slots in
    its view, so zipar-sjd refuses it."""
    from fastar.errors import FastARError

    model, conditioning = family
    ar, _ = greedy(model, conditioning, DecoderSpec("ar"))
    tokens, _ = greedy(model, conditioning, DecoderSpec("zipar", zipar_lead=model.grid[1], zipar_attention="reference"))
    assert torch.equal(tokens, ar)
    with pytest.raises(FastARError, match="plain zipar"):
        greedy(model, conditioning, DecoderSpec("zipar-sjd", window=3, zipar_attention="reference"))

