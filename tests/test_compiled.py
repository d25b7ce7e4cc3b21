"""Compiled steps (model_loaders/shared/compiled.py): a model whose session steps run through torch.compile gives the
same tokens as eager for the same seed (ar, sjd with a window wider and narrower than a row, spec with a drafter;
CFG, temperature, top-k and top-p; batch 2), its logits match eager's, and only token models take the switch."""
from pathlib import Path

import pytest
import torch

from fastar.errors import FastARError
from fastar.model_loaders.drafters.small_ar import SmallARDrafter
from fastar.model_loaders.shared.compiled import compile_steps, compiled_mode
from fastar.model_loaders.shared.protocol import ClassConditioning
from fastar.samplers.decoders import DecoderSpec, decode
from fastar.samplers.processing import SamplingSettings
from tiny_llamagen import tiny_conditioning, tiny_model
from test_mar import tiny_mar

ROOT = Path(__file__).resolve().parent.parent
SAMPLING = SamplingSettings(cfg_scale=2.0, temperature=0.9, top_k=20, top_p=0.95)
SPECS = [DecoderSpec("ar"), DecoderSpec("sjd", window=3), DecoderSpec("sjd", window=7, coupling="maximal")]


@pytest.fixture(scope="module")
def models():
    return tiny_model(seed=3), compile_steps(tiny_model(seed=3))


@pytest.fixture(autouse=True)
def steps_really_compile():
    """A machine that cannot compile falls back to eager (tested below, in a subprocess): here that would make
    every equality eager against eager, so it fails instead."""
    yield
    from fastar.model_loaders.shared.compiled import compiled_forward
    from fastar.model_loaders.llamagen.model import LlamaGenSession

    assert compiled_forward(LlamaGenSession, "default").failure is None


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
    assert compiled_mode(compiled) == "default" and compiled_mode(eager) is None


def test_only_token_models_and_mar_take_compiled_steps():
    mar = tiny_mar(0)
    assert compile_steps(mar, "auto") is mar and compiled_mode(mar) is None  # its head: tests/test_head_steps.py
    with pytest.raises(FastARError, match="unknown compile setting 'yes': choose one of auto, on, off"):
        compile_steps(tiny_model(seed=3), "yes")


def test_auto_compiles_where_proven_and_the_switch_is_read_at_each_start(monkeypatch):
    """auto: compiled on the device types proven (CPU here, CUDA by the GPU check), eager on others (here: the CPU
    taken off the list); the device is read when a session starts, as ComfyUI moves models between devices."""
    import fastar.model_loaders.shared.compiled as compiled

    model = compile_steps(tiny_model(seed=3), "auto")
    assert compiled_mode(model) == "default"
    assert isinstance(model.start(tiny_conditioning(model), cfg=True, max_window=4).forward, compiled.BoundStep)
    monkeypatch.setitem(compiled.AUTO_DEVICES, "token-ar", ())
    assert compiled_mode(model) is None
    assert not isinstance(model.start(tiny_conditioning(model), cfg=True, max_window=4).forward, compiled.BoundStep)
    assert compiled_mode(compile_steps(model, "on")) == "default"  # on: every device
    assert compiled_mode(compile_steps(model, "off")) is None


def test_the_switch_at_load_time():
    from fastar.model_loaders.shared.demo import DEMO_KL, DEMO_MAR
    from fastar.pipeline import load_models

    assert compiled_mode(load_models(None, None, "cpu", compile_switch="on").ar) == "default"
    assert compiled_mode(load_models(None, None, "cpu").ar) is None  # off unless asked: a one-shot run never repays it
    assert compiled_mode(load_models(str(DEMO_MAR), str(DEMO_KL), "cpu", compile_switch="on").ar) == "default"


def test_a_machine_that_cannot_compile_decodes_eagerly_with_a_warning(tmp_path):
    """No C++ compiler for inductor's CPU kernels (CXX points nowhere, an empty kernel cache): one warning that
    says so and what to do, then the same tokens as eager."""
    import os
    import subprocess
    import sys

    script = (
        "import warnings, torch\n"
        "from fastar.model_loaders.shared.compiled import compile_steps\n"
        "from fastar.samplers.decoders import DecoderSpec, decode\n"
        "from fastar.samplers.processing import SamplingSettings\n"
        "from tiny_llamagen import tiny_conditioning, tiny_model\n"
        "eager, compiled = tiny_model(seed=3), compile_steps(tiny_model(seed=3))\n"
        "s = SamplingSettings(cfg_scale=2.0, top_k=20)\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    for seed in (0, 1):\n"
        "        got, _ = decode(compiled, tiny_conditioning(compiled), s, DecoderSpec('sjd', window=3), seed=seed)\n"
        "        want, _ = decode(eager, tiny_conditioning(eager), s, DecoderSpec('sjd', window=3), seed=seed)\n"
        "        assert torch.equal(got, want)\n"
        "notes = [str(w.message) for w in caught if 'compiled steps are off' in str(w.message)]\n"
        "print(len(notes), notes[0])\n")
    env = os.environ | {"CXX": str(tmp_path / "no-such-compiler"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"),
                        "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(__file__), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    count, note = r.stdout.split(" ", 1)
    assert count == "1" and "torch.compile failed on this machine" in note and "Install a C++ compiler" in note


def test_a_first_run_reports_its_compilation_apart():
    """The run that compiles a shape says how long compiling took (kept out of decode_time_s, which speed-ups
    use); the next run of that shape compiles nothing."""
    model = compile_steps(tiny_model(seed=5))
    spec = DecoderSpec("sjd", window=5)  # a width no other test compiles
    _, first = decode(model, tiny_conditioning(model), SAMPLING, spec, seed=0)
    _, second = decode(model, tiny_conditioning(model), SAMPLING, spec, seed=1)
    assert 0 < first.compile_time_s < first.wall_time_s  # tracing alone takes a while, even from a warm kernel cache
    assert first.decode_time_s == first.wall_time_s - first.compile_time_s
    assert second.compile_time_s == 0.0 and second.decode_time_s == second.wall_time_s


@pytest.mark.parametrize("shape", ["lumina-tiny", "janus-tiny"])
def test_layout_models_compile_to_eagers_tokens(shape):
    """Chameleon-family (row-end tokens inside windows that cross a row) and Janus sessions, which ComfyUI's
    auto switch compiles on a CPU like LlamaGen's: the same tokens as eager for ar and sjd."""
    from fastar.model_loaders.shared.protocol import PromptConditioning
    from fastar.commands.profile.speed import build

    eager = build(shape, torch.device("cpu"), torch.float32)
    compiled = compile_steps(build(shape, torch.device("cpu"), torch.float32))
    prompts = PromptConditioning(["a photo", "a dog"])
    for spec in (DecoderSpec("ar"), DecoderSpec("sjd", window=6, coupling="maximal")):
        want, _ = decode(eager, prompts, SAMPLING, spec, seed=1)
        got, stats = decode(compiled, prompts, SAMPLING, spec, seed=1)
        assert torch.equal(got, want)
    from fastar.model_loaders.shared.compiled import compiled_forward
    from fastar.model_loaders.shared.llm_decoder import LayoutSession

    assert compiled_forward(LayoutSession, "default").failure is None  # compiled, not fallen back to eager


@pytest.mark.parametrize("shape", ["llamagen", "lumina-tiny"])
def test_zipar_feeds_run_compiled_to_eagers_tokens_in_a_few_shapes(shape):
    """ZipAR's feeds anywhere (``forward_at``) run compiled too, with eager's tokens (zipar and zipar-sjd, sampled
    with CFG, top-k and top-p, batch 2; LlamaGen's layout and Lumina-mGPT's row ends, a grid wider than tall),
    and a forward's feed count, which changes as rows start and finish, comes in a few buckets (powers of two up
    to the bound), each one compiled shape."""
    from fastar.commands.profile.speed import build
    from fastar.model_loaders.llamagen.model import LlamaGenSession
    from fastar.model_loaders.shared.compiled import compiled_forward
    from fastar.model_loaders.shared.llm_decoder import LayoutSession
    from fastar.model_loaders.shared.protocol import PromptConditioning
    from fastar.samplers.token_loops.zipar import zipar_feeds

    if shape == "llamagen":
        eager, compiled = (tiny_model(seed=3, grid=(4, 7)) for _ in range(2))
        conditioning, session_class = tiny_conditioning(eager), LlamaGenSession
    else:
        eager, compiled = (build(shape, torch.device("cpu"), torch.float32) for _ in range(2))
        conditioning, session_class = PromptConditioning(["a photo", "a dog"]), LayoutSession
    compile_steps(compiled)
    step = compiled_forward(session_class, "default", "forward_at")
    before = set(step.shapes_run)
    specs = (DecoderSpec("zipar", zipar_lead=1), DecoderSpec("zipar-sjd", zipar_lead=2, window=3))
    for spec in specs:
        want, _ = decode(eager, conditioning, SAMPLING, spec, seed=1)
        got, _ = decode(compiled, conditioning, SAMPLING, spec, seed=1)
        assert torch.equal(got, want), spec.decoder
    assert step.failure is None
    counts = {shapes[0][0][1] for shapes in step.shapes_run - before}  # tokens [rows, feeds]
    bounds = {zipar_feeds(eager.grid, s.zipar_lead, s.window) for s in specs}
    assert counts and all(m in bounds or m & (m - 1) == 0 for m in counts), counts


class Cancelled(Exception):
    pass


def test_cancel_during_a_first_compile_returns_at_once_and_the_compiled_graph_is_kept(models, monkeypatch):
    """Under a registered check (ComfyUI's Cancel) a shape's first call compiles in a worker thread: a cancel
    raised while it compiles ends the run at once (the compilation still under way), and once it finishes the
    graph serves the next run of that shape without compiling again, with eager's tokens. Under inference mode,
    as ComfyUI runs nodes: the worker must keep it to update the session's cache."""
    import threading

    from fastar.interrupts import interruptible
    from fastar.model_loaders.shared.compiled import compiled_forward, unique_graphs
    from fastar.model_loaders.llamagen.model import LlamaGenSession

    eager, compiled = models
    step = compiled_forward(LlamaGenSession, "default")
    # shapes no other test has; ar: no loop step (samplers/token_loops/loop_step.py) compiling graphs of its own besides
    spec, rows = DecoderSpec("ar"), ClassConditioning(torch.tensor([1, 2, 3]))
    # the compilation starts only once the cancel came: however fast this machine compiles, it is under way
    cancelled, real = threading.Event(), step.compiled
    monkeypatch.setattr(step, "compiled", lambda *args, **kwargs: cancelled.wait(60) and real(*args, **kwargs))
    still_compiling = []

    def cancel():
        still_compiling.append(step.compiling.locked())
        cancelled.set()
        raise Cancelled

    with pytest.raises(Cancelled), interruptible(cancel), torch.inference_mode():
        decode(compiled, rows, SAMPLING, spec, seed=0)
    assert still_compiling == [True]
    with step.compiling:  # the abandoned compilation ends in its own time
        graphs = unique_graphs()
    assert graphs > 0
    with torch.inference_mode():
        with interruptible(lambda: None):
            got, _ = decode(compiled, rows, SAMPLING, spec, seed=0)
        decode(compiled, rows, SAMPLING, spec, seed=1)  # in this thread, as every later step
    assert unique_graphs() == graphs, "the graph compiled in the background was not reused"
    want, _ = decode(eager, rows, SAMPLING, spec, seed=0)
    assert torch.equal(got, want)


def test_a_session_started_in_another_thread_may_compile_many_shapes():
    """Dynamo's settings are per thread and asyncio task in recent torch (ComfyUI runs each node in a task): a
    compiled session started anywhere must allow every shape a model meets, not dynamo's default 8, past which
    steps run eagerly without a word (as a long ComfyUI session found)."""
    import threading

    from fastar.model_loaders.shared.compiled import COMPILED_SHAPES

    model, seen = compile_steps(tiny_model(seed=5)), []

    def start():
        model.start(tiny_conditioning(model), cfg=True, max_window=4)
        config = torch._dynamo.config
        seen.append(getattr(config, "recompile_limit", None) or config.cache_size_limit)

    worker = threading.Thread(target=start)
    worker.start()
    worker.join()
    assert seen[0] >= COMPILED_SHAPES


def test_a_compile_failure_not_about_a_compiler_does_not_advise_installing_one(monkeypatch):
    from fastar.model_loaders.shared.compiled import CompiledStep

    def fail(*args, **kwargs):
        raise RuntimeError("an operator inductor does not support")

    step = CompiledStep(lambda session, x: x + 1, "default")
    monkeypatch.setattr(step, "compiled", fail)
    with pytest.warns(UserWarning) as caught:
        assert step(None, torch.ones(2)).tolist() == [2.0, 2.0]  # eager's answer
    note = str(caught[0].message)
    assert "an operator inductor does not support" in note and "C++" not in note and "Turn the compile switch off" in note


def test_cuda_graph_steps_reuse_zeroed_caches_and_give_eagers_tokens():
    """Mode reduce-overhead (CUDA's: each step a replayed CUDA graph) takes its KV caches from the model's static
    buffers, so the graph's addresses hold from one generation to the next: the same buffers again for the same
    shape (ar's and sjd's sessions too: cache lengths in buckets), zeroed (a NaN left by an earlier run must not reach the next through masked slots), replaced (not
    added to) for another shape; tokens as eager's. On a CPU inductor runs the same code without the graphs."""
    eager = tiny_model(seed=3)
    model = compile_steps(tiny_model(seed=3), "on", mode="reduce-overhead")
    spec = DecoderSpec("sjd", window=3)
    addresses = []
    for seed in (0, 1):
        got, _ = decode(model, tiny_conditioning(model), SAMPLING, spec, seed=seed)
        want, _ = decode(eager, tiny_conditioning(eager), SAMPLING, spec, seed=seed)
        assert torch.equal(got, want)
        addresses.append([b.data_ptr() for b in model.static_buffers.buffers])
        for buffer in model.static_buffers.buffers:
            buffer.fill_(float("nan"))
    assert addresses[0] == addresses[1] and len(addresses[0]) == 2 * len(model.layers)
    # ar's session needs fewer scratch slots than sjd's: the same bucket, so decoders taking turns share buffers
    got, _ = decode(model, tiny_conditioning(model), SAMPLING, DecoderSpec("ar"), seed=5)
    assert torch.equal(got, decode(eager, tiny_conditioning(eager), SAMPLING, DecoderSpec("ar"), seed=5)[0])
    assert [b.data_ptr() for b in model.static_buffers.buffers] == addresses[0]
    rows = ClassConditioning(torch.tensor([4, 5, 6]))
    got, _ = decode(model, rows, SAMPLING, spec, seed=2)
    assert torch.equal(got, decode(eager, rows, SAMPLING, spec, seed=2)[0])
    assert len(model.static_buffers.buffers) == 2 * len(model.layers)
    assert model.static_buffers.buffers[0].shape[0] == 6  # 3 rows and their CFG rows
    assert not hasattr(eager, "static_buffers")


def test_prompts_of_other_lengths_share_one_compiled_step():
    """A text model's step is compiled for its prefix length: compiled sessions pad prefixes to a bucket, so a
    prompt of another length reuses the graph (tokens as eager's, unpadded: test_layout_models_compile_...)."""
    from fastar.model_loaders import load_ar_model
    from fastar.model_loaders.shared.compiled import unique_graphs
    from fastar.model_loaders.shared.compiled_session import PREFIX_BUCKET
    from fastar.model_loaders.shared.protocol import PromptConditioning

    model = compile_steps(load_ar_model(str(ROOT / "demo" / "demo_text")))  # a real tokenizer
    spec = DecoderSpec("sjd", window=4)
    lengths, graphs = [], []
    prompts = [PromptConditioning([text]) for text in ("a red ring", "a small blue square on a yellow background")]
    raw = [len(model.prefixes(model.prompts.encode(p), cfg=False)[0]) for p in prompts]
    assert raw[0] != raw[1] and max(raw) < PREFIX_BUCKET
    for prompt in prompts:
        session = model.start(prompt, cfg=True, max_window=4)
        lengths.append(session.prefix_len)
        decode(model, prompt, SAMPLING, spec, seed=0)
        graphs.append(unique_graphs())
    assert lengths[0] == lengths[1] and lengths[0] % PREFIX_BUCKET == 0
    assert graphs[1] == graphs[0], "the second prompt's length compiled the step again"


def test_one_compiled_graph_serves_every_key_length():
    """A session's forwards attend over more of the cache as an image fills (transformer.attended_slots): the
    length is dynamic in the compiled step, so one graph serves every length (CUDA records a graph per length),
    each with eager's logits."""
    from fastar.model_loaders.shared.compiled import unique_graphs

    rows = ClassConditioning(torch.tensor([1, 2, 3]))  # a batch no other test compiles
    sessions = [model.start(rows, cfg=True, max_window=3) for model in (tiny_model(seed=7),
                                                                         compile_steps(tiny_model(seed=7)))]
    tokens, graphs, lengths = torch.tensor([[1, 2, 3]] * 3), None, set()
    for position, horizon in ((0, 3), (6, 9), (13, 16), (13, 10_000)):  # the last: every slot
        start, keys = torch.full((3,), position), [s.key_slots(horizon) for s in sessions]
        eager, compiled = (s.forward(tokens, start, k) for s, k in zip(sessions, keys))
        assert torch.allclose(compiled.cond, eager.cond, atol=1e-5)
        assert torch.allclose(compiled.uncond, eager.uncond, atol=1e-5)
        graphs, lengths = graphs or unique_graphs(), lengths | {len(keys[1])}
    assert unique_graphs() == graphs and len(lengths) == 4 and max(lengths) == sessions[1].total_slots


def test_a_finished_compiled_session_is_freed_at_once():
    """Its KV caches go when the last reference does (reference counting), not whenever the cycle collector
    runs: on a GPU that is gigabytes held for nothing."""
    import gc
    import weakref

    model = compile_steps(tiny_model(seed=3))
    gc.disable()
    try:
        session = model.start(tiny_conditioning(model), cfg=True, max_window=4)
        session.forward(torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]), torch.tensor([2, 5]))
        cache = weakref.ref(session.caches[0].k)
        del session
        assert cache() is None, "the finished session's caches are still alive"
    finally:
        gc.enable()


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_8_bit_blocks_compile_to_eagers_tokens(fmt):
    """The dequantisation goes into the compiled step (where it fuses with the matmul); the tokens stay eager's."""
    from fastar.model_loaders.shared.quantized import quantize_weights

    eager = quantize_weights(tiny_model(seed=3), fmt)
    compiled = compile_steps(quantize_weights(tiny_model(seed=3), fmt))
    for spec in (DecoderSpec("ar"), DecoderSpec("sjd", window=3)):
        want, _ = decode(eager, tiny_conditioning(eager), SAMPLING, spec, seed=0)
        got, _ = decode(compiled, tiny_conditioning(compiled), SAMPLING, spec, seed=0)
        assert torch.equal(got, want)


def test_only_a_repeat_of_the_previous_call_skips_dynamos_full_guards(monkeypatch):
    """A call that repeats its session's previous one (same argument shapes) evaluates only the guards that tell
    graphs apart (compiled.py: a millisecond per call at 32 layers); any other call is guarded in full. Here a
    session that keeps hidden states (what an EAGLE drafter reads) follows one that does not, with the same
    shapes: only the full guards see the difference, and it gets its hidden states, as eager's."""
    stances = []
    real = torch.compiler.set_stance
    monkeypatch.setattr(torch.compiler, "set_stance", lambda *a, **k: stances.append(k) or real(*a, **k))
    eager, model = tiny_model(seed=6), compile_steps(tiny_model(seed=6))
    tokens, start = torch.tensor([[1], [2]]), torch.tensor([3, 4])

    def calls(session, n):
        outputs = [session.forward(tokens, start) for _ in range(n)]
        return outputs[-1], len(stances)

    plain = model.start(tiny_conditioning(model), cfg=True, max_window=4)
    assert calls(plain, 3)[1] == 2  # the first call guarded in full, its repeats not
    kept = model.start(tiny_conditioning(model), cfg=True, max_window=4, hidden=True)
    out, skipped = calls(kept, 2)
    want = eager.start(tiny_conditioning(eager), cfg=True, max_window=4, hidden=True)
    for _ in range(2):
        expected = want.forward(tokens, start)
    assert out.hidden is not None and torch.allclose(out.hidden, expected.hidden, atol=1e-5)
    assert torch.allclose(out.cond, expected.cond, atol=1e-5)
    assert skipped == 3  # another session: in full first
    assert calls(plain, 1)[1] == 3 and calls(plain, 1)[1] == 4  # back to the first session: in full, then not
    plain.forward(torch.tensor([[1, 2], [3, 4]]), start)  # another width: in full
    assert len(stances) == 4 and all(s == {"skip_guard_eval_unsafe": True} for s in stances)
    from fastar.model_loaders.shared.compiled import guards_in_full

    with guards_in_full():  # the profile's comparison: repeats guarded in full too
        assert calls(plain, 2)[1] == 4
    import fastar.model_loaders.shared.compiled as compiled

    monkeypatch.setattr(compiled, "CAN_SKIP_GUARDS", False)  # torch < 2.6: no such stance, every call in full
    assert calls(plain, 2)[1] == 4
    from fastar.commands.profile.kernels import kernel_breakdown

    host = kernel_breakdown(lambda: plain.forward(tokens, start), torch.device("cpu"))["dynamo_host_ms"]
    assert host["guards"] > 0 and host["inputs"] > 0  # what profile --kernels reports of a compiled step


def test_a_repeat_whose_tensors_changed_is_guarded_in_full_again():
    """Skipping guards still checks every tensor's dtype, shape and device; where one the step reads changed
    since the previous call, no graph fits and the call runs again with full guards (it compiles), instead of
    failing, or turning compiled steps off."""
    from types import SimpleNamespace

    from fastar.model_loaders.shared.compiled import CompiledStep

    step = CompiledStep(lambda session, x: x * session.scale, "default")
    session = SimpleNamespace(scale=torch.full((3,), 2.0))
    for _ in range(2):
        assert step(session, torch.ones(3), caller=1).tolist() == [2.0, 2.0, 2.0]
    session.scale = torch.full((3,), 3.0, dtype=torch.float64)
    got = step(session, torch.ones(3), caller=1)
    assert got.dtype == torch.float64 and got.tolist() == [3.0, 3.0, 3.0] and step.failure is None
