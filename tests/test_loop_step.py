"""Compiled loop steps (samplers/token_loops/loop_step.py): the work of a Jacobi or drafter-chain iteration after its forward
(sampling, verification, the next drafts) runs through torch.compile where the model's steps do, with its random
numbers drawn beforehand (samplers/token_loops/drawn_noise.py), and a seed gives eager's very tokens: every rule, draft
initialisation and coupling, greedy and sampled, CFG, top-k and top-p, batch 2."""
import pytest
import torch

from fastar.errors import FastARError
from fastar.model_loaders.drafters.small_ar import SmallARDrafter
from fastar.model_loaders.shared.compiled import BoundStep, compile_steps, compiled_function, graph_breaks, unique_graphs
from fastar.samplers.decoders import DecoderSpec, decode
from fastar.samplers.token_loops.drawn_noise import Drawn, Recording, draw
from fastar.samplers.token_loops.loop_step import compiled_loop_step
from fastar.samplers.token_loops.trees import STATIC_SHAPES
from fastar.samplers.processing import SamplingSettings, random_codes, uniform
from tiny_llamagen import tiny_conditioning, tiny_model

SAMPLING = SamplingSettings(cfg_scale=2.0, temperature=0.9, top_k=20, top_p=0.95)
VARIANTS = {  # each a loop step of its own: another rule, draft source or pipeline branch
    "gsd": (DecoderSpec("gsd", window=5, group=4), SAMPLING),
    "sample-above-gumbel": (DecoderSpec("sjd", window=6, init="sample-above", coupling="gumbel"), SAMPLING),
    "vertical-maximal": (DecoderSpec("sjd", window=4, init="vertical", coupling="maximal"),
                         SamplingSettings(cfg_scale=1.0, temperature=1.3)),
    "greedy-lantern": (DecoderSpec("lantern", window=4, lantern_k=8, lantern_delta=0.2),
                       SamplingSettings(cfg_scale=3.0, temperature=0.0)),
    "sjd-pac": (DecoderSpec("sjd-pac", window=10, pac_branches=2, pac_depth=3, coupling="maximal",
                            init="sample-left"), SAMPLING),
    "sjd-entropy": (DecoderSpec("sjd-entropy", window=5, entropy_strength=0.7), SAMPLING),
}


@pytest.fixture(scope="module")
def models():
    return tiny_model(seed=5), compile_steps(tiny_model(seed=5))


def loop_step():
    return compiled_loop_step("default")


def counted(monkeypatch, step) -> list:
    """The calls that go through ``step``'s compiled function from now on (not its eager fallback)."""
    calls, real = [], step.compiled
    monkeypatch.setattr(step, "compiled", lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
    return calls


@pytest.mark.parametrize("name", VARIANTS)
def test_compiled_loop_steps_give_eagers_tokens(models, monkeypatch, name):
    eager, compiled = models
    spec, sampling = VARIANTS[name]
    codebook = eager.code_embeddings() if spec.decoder == "lantern" else None
    calls, breaks = counted(monkeypatch, loop_step()), graph_breaks()
    for seed in (0, 1):
        want, _ = decode(eager, tiny_conditioning(eager), sampling, spec, seed=seed, codebook=codebook)
        got, stats = decode(compiled, tiny_conditioning(compiled), sampling, spec, seed=seed, codebook=codebook)
        assert torch.equal(got, want)
    assert stats.target_forwards < got.shape[1] - 1 or name == "greedy-lantern"  # windows really fixed several
    assert loop_step().failure is None and len(calls) >= stats.target_forwards - 1  # compiled, not eager
    assert graph_breaks() == breaks  # one graph, whatever other tests compiled before in this process


def test_a_drafter_chain_compiles_to_eagers_tokens(models, monkeypatch):
    eager, compiled = models
    drafter = SmallARDrafter(tiny_model(seed=6))
    spec = DecoderSpec("spec", gamma=3)
    calls = counted(monkeypatch, loop_step())
    for seed in (0, 1):
        want, _ = decode(eager, tiny_conditioning(eager), SAMPLING, spec, seed=seed, drafter=drafter)
        calls.clear()
        got, stats = decode(compiled, tiny_conditioning(compiled), SAMPLING, spec, seed=seed, drafter=drafter)
        assert torch.equal(got, want)
    # every iteration's verification and 3 picks (the chain's draws), compiled but for each loop step's first
    # call (the verification's and the picks', run eagerly to record what they draw)
    assert len(calls) == 4 * stats.target_forwards - 2


def test_a_drafter_compiles_its_steps_exactly_when_its_target_does(models):
    """A drafter of the same family follows its target's compile switch at each start (one drafter object may
    serve an eager and a compiled target in turn)."""
    eager, compiled = models
    drafter = SmallARDrafter(tiny_model(seed=6))
    rows = tiny_conditioning(compiled)
    for target, steps_compile in ((compiled, True), (eager, False), (compiled, True)):
        target_session = target.start(rows, cfg=True, max_window=4)
        draft_session = drafter.start(rows, cfg=True, max_window=4, target_session=target_session)
        assert isinstance(draft_session.session.forward, BoundStep) == steps_compile


def test_a_new_slider_value_reuses_the_compiled_loop_step(models):
    """Moving the cfg scale or temperature must not compile the step again each time (dynamo would specialise
    on every float; the loop step is dynamic where calls differ): at most one more graph for three new values."""
    _, compiled = models
    spec = DecoderSpec("sjd", window=3)
    decode(compiled, tiny_conditioning(compiled), SAMPLING, spec, seed=0)
    before = unique_graphs()
    for cfg, temperature in ((2.5, 0.8), (3.5, 1.1), (4.5, 0.7)):
        sampling = SamplingSettings(cfg_scale=cfg, temperature=temperature, top_k=20, top_p=0.95)
        decode(compiled, tiny_conditioning(compiled), sampling, spec, seed=0)
    assert unique_graphs() - before <= 1, unique_graphs() - before


def test_an_eager_model_runs_its_loop_steps_eagerly(models, monkeypatch):
    eager, _ = models
    calls = counted(monkeypatch, loop_step())
    decode(eager, tiny_conditioning(eager), SAMPLING, DecoderSpec("sjd", window=9), seed=0)
    assert calls == []


def test_recorded_draws_repeat_the_generators_numbers():
    """Drawn beforehand in the recorded order, a step's numbers are the ones it would have drawn in place."""
    in_place, recorded, again = (torch.Generator().manual_seed(7) for _ in range(3))
    want = [uniform((2, 3), in_place), random_codes(50, (2, 4), in_place), uniform((5, 1), in_place)]
    recording = Recording(recorded)
    made = [uniform((2, 3), recording), random_codes(50, (2, 4), recording), uniform((5, 1), recording)]
    drawn = Drawn(draw(recording.calls, again))
    replayed = [uniform((2, 3), drawn), random_codes(50, (2, 4), drawn), uniform((5, 1), drawn)]
    drawn.check_all_used()
    for a, b, c in zip(want, made, replayed):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert torch.equal(uniform((3,), in_place), uniform((3,), again))  # both generators moved on alike


def test_a_step_whose_draws_depend_on_data_is_refused():
    drawn = Drawn((torch.rand(2, 3), torch.randint(9, (4,))))
    with pytest.raises(FastARError, match="must not depend on data"):
        uniform((2, 4), drawn)  # another shape than was recorded
    uniform((2, 3), drawn)
    with pytest.raises(FastARError, match="must not depend on data"):
        uniform((4,), drawn)  # codes were drawn here, not uniform numbers
    with pytest.raises(FastARError, match="used 1 of the 2"):
        drawn.check_all_used()


@pytest.mark.parametrize("spec", [DecoderSpec("sjd", window=4), DecoderSpec("spec", gamma=2)], ids=lambda s: s.decoder)
def test_progress_read_an_iteration_late_changes_no_token(models, monkeypatch, spec):
    """CUDA's way (verifier.RowProgress), run on the CPU: each iteration's progress is read after the next one is
    queued, so the loop runs one iteration past the end. It must fix nothing: the same tokens, the same record
    of when each was fixed, one more forward whose count is 0; progress reports never go backwards."""
    from fastar.samplers.token_loops import verifier

    eager, _ = models
    drafter = SmallARDrafter(tiny_model(seed=6)) if spec.decoder == "spec" else None
    runs = {}
    for lag in (0, 1):
        monkeypatch.setattr(verifier, "LAG_BY_DEVICE", {"cpu": lag})
        seen = []
        runs[lag] = decode(eager, tiny_conditioning(eager), SAMPLING, spec, seed=3, drafter=drafter,
                           on_iteration=lambda done, total, tokens: seen.append(done))
        assert seen == sorted(seen) and seen[-1] == runs[lag][0].shape[1]
    (want, plain), (got, late) = runs[0], runs[1]
    assert torch.equal(got, want) and late.fixed_at == plain.fixed_at
    assert late.target_forwards == plain.target_forwards + 1
    assert late.fixed_per_forward == plain.fixed_per_forward + [[0, 0]]


def test_an_eagle_drafter_compiles_with_its_target_to_eagers_tokens(monkeypatch):
    """The bundled demo model and its EAGLE drafter (LANTERN's format): with the target's steps compiled, the
    head's catch-up and draft steps and the draft picks run compiled too, and a seed gives eager's tokens."""
    from fastar.model_loaders.drafters.eagle import EagleSession
    from fastar.pipeline import class_conditioning, load_models

    eager, compiled = (load_models(None, None, "cpu", compile_switch=switch, drafter_path="demo")
                       for switch in ("off", "on"))
    spec, breaks = DecoderSpec("spec", gamma=3), graph_breaks()
    calls = {method: counted(monkeypatch, compiled_function(method, "default"))
             for method in (EagleSession.caught_up, EagleSession.stepped)}
    for seed in (0, 1):
        want, _ = decode(eager.ar, class_conditioning(eager.ar, [2, 5]), SAMPLING, spec, seed=seed,
                         drafter=eager.drafter)
        got, stats = decode(compiled.ar, class_conditioning(compiled.ar, [2, 5]), SAMPLING, spec, seed=seed,
                            drafter=compiled.drafter)
        assert torch.equal(got, want)
    assert stats.target_forwards < got.shape[1] / 2  # the trained drafter's drafts are accepted
    for method, made in calls.items():
        assert compiled_function(method, "default").failure is None and made, method.__name__
    assert graph_breaks() == breaks  # each step one graph, whatever other tests compiled before in this process


@pytest.mark.parametrize("spec,drafter_kind", [
    (DecoderSpec("lantern", tree="static", tree_shape="small", lantern_lambda=2.0), "eagle"),
    (DecoderSpec("spec", tree="dynamic", tree_depth=2, tree_topk=3, tree_nodes=6), "small-ar"),
], ids=["lantern++-eagle", "dynamic-small-ar"])
def test_draft_trees_compile_to_eagers_tokens(models, tmp_path, monkeypatch, spec, drafter_kind):
    """The target's tree forwards, the drafter's growth and the verification all compiled; a seed gives eager's
    tokens. (Small trees: each depth's growth is a graph of its own, compiled in seconds each.)"""
    monkeypatch.setitem(STATIC_SHAPES, "small", ((3,), (2, 1, 0)))
    eager, compiled = models
    if drafter_kind == "eagle":
        from fastar.model_loaders.drafters.loader import load_drafter
        from test_drafters import eagle_config, eagle_weights, write_drafter
        folder = write_drafter(tmp_path / "eagle", eagle_weights(), eagle_config())
        drafters = load_drafter(folder, eager), load_drafter(folder, compiled)
    else:
        drafters = SmallARDrafter(tiny_model(seed=6)), SmallARDrafter(tiny_model(seed=6))
    codebook = eager.code_embeddings()
    for seed in (0, 1):
        want, _ = decode(eager, tiny_conditioning(eager), SAMPLING, spec, seed=seed, drafter=drafters[0],
                         codebook=codebook)
        got, stats = decode(compiled, tiny_conditioning(compiled), SAMPLING, spec, seed=seed, drafter=drafters[1],
                            codebook=codebook)
        assert torch.equal(got, want)
    assert stats.compile_time_s >= 0 and max(max(row) for row in stats.fixed_per_forward) >= 2
