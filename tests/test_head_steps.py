"""MAR's diffusion head on compiled reverse steps (samplers/masked_loops/head_steps.py): the same tokens as eager (to the
rounding of fused kernels) for MAR's sampler with CFG on its linear schedule, a temperature, batch 1 and 2, head
reuse, and CSpD with its draft; one graph for every step's token count and for other cfg scales and
temperatures; the switch's reach (auto: not yet; on: MAR's head; never VAR)."""
from dataclasses import replace

import pytest
import torch

from fastar.errors import FastARError
from fastar.model_loaders import load_ar_model
from fastar.model_loaders.drafters.loader import load_drafter
from fastar.model_loaders.shared.compiled import (CompiledStep, compile_steps, compiled_function, compiled_mode,
                                                  unique_graphs)
from fastar.model_loaders.shared.demo import DEMO_MAR
from fastar.model_loaders.shared.protocol import ClassConditioning
from fastar.samplers.masked_loops.cspd import CSpDSettings
from fastar.samplers.decoders import decode_masked
from fastar.samplers.masked_loops.feature_reuse import FeatureReuse
from fastar.samplers.masked_loops.head_steps import compiled_update
from fastar.samplers.masked_loops.masked import MaskedSettings
from test_mar import tiny_mar

SETTINGS = MaskedSettings(num_iter=4, cfg_scale=3.0, temperature=0.9, diffusion_steps=8)  # linear CFG: a scale per step
# fused kernels round differently from eager's ops, and the first reverse steps multiply eps by up to 20,000, so a
# token can fork to another mode and the rest of its image follow it (which one depends on the CPU's kernels): the
# median difference stays with the tokens that did not fork, 1e-5 to 4e-5 on the demo, where a temperature of 1
# instead of 0.9 moves it by 30-50% and another seed by 100% or more (the GPU check judges its MAR runs alike)
CLOSE = 1e-3


def apart(a: torch.Tensor, b: torch.Tensor) -> float:
    """How far apart two runs' tokens are: the median difference relative to the mean token."""
    return float((a - b).abs().median() / b.abs().mean())


@pytest.fixture(autouse=True)
def steps_really_compile():
    """A machine that cannot compile falls back to eager, which would make every comparison eager against eager."""
    yield
    assert compiled_function(compiled_update, "default").failure is None


@pytest.fixture(scope="module")
def demo():
    """The bundled demo MAR (trained: its guidance and temperature change its tokens clearly) and its draft, eager,
    and the same MAR with its head's steps compiled."""
    eager = load_ar_model(DEMO_MAR)
    return eager, load_drafter("demo", eager), compile_steps(load_ar_model(DEMO_MAR), "on")


def run(model, labels, settings=SETTINGS, seed=0, decoder="ar", drafter=None):
    return decode_masked(model, ClassConditioning(torch.tensor(labels)), settings, decoder, seed=seed,
                         drafter=drafter, cspd=CSpDSettings())


def compiled_calls(monkeypatch) -> list:
    """From now on, every call of a compiled step (the real one runs) leaves its function's name in the list
    returned: ``compiled_update`` for a reverse step, ``conditions`` for a transformer call."""
    calls, real = [], CompiledStep.compiled_or_eager

    def counted(self, *args, **kwargs):
        calls.append(self.eager.__name__)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(CompiledStep, "compiled_or_eager", counted)
    return calls


@pytest.mark.parametrize("labels,settings", [
    ((1, 2), SETTINGS),
    ((3,), replace(SETTINGS, num_iter=16, cfg_schedule="constant")),  # one image: its first step predicts one token
    ((1, 2), replace(SETTINGS, cfg_scale=1.0)),  # no CFG: the head sees cond rows alone
    ((1, 2), replace(SETTINGS, reuse=FeatureReuse(start_percent=0.0, head_refresh_every=3))),  # LazyMAR's head reuse
], ids=["batch-2", "batch-1", "no-cfg", "head-reuse"])
def test_compiled_head_steps_give_eagers_tokens(demo, labels, settings, monkeypatch):
    eager, _, compiled = demo
    want, _ = run(eager, labels, settings)
    calls = compiled_calls(monkeypatch)
    got, stats = run(compiled, labels, settings)
    # every reverse step and every transformer call ran compiled...
    assert calls.count("compiled_update") == settings.num_iter * settings.diffusion_steps
    assert calls.count("conditions") == (settings.num_iter if settings.reuse is None else 0)  # reuse's stays eager
    assert apart(got, want) < CLOSE  # ...and drew eager's tokens
    other, _ = run(eager, labels, settings, seed=1)
    assert apart(other, want) > 30 * CLOSE  # which another seed does not
    assert stats.target_forwards == settings.num_iter


def test_cspd_compiles_its_draft_and_target_heads_alike(demo, monkeypatch):
    eager, draft, compiled = demo
    want, _ = run(eager, (0, 1), decoder="cspd", drafter=draft)
    calls = compiled_calls(monkeypatch)
    got, stats = run(compiled, (0, 1), decoder="cspd", drafter=draft)
    heads = stats.target_forwards + stats.drafter_forwards  # the draft's calls and the target's scoring calls
    assert calls.count("compiled_update") == heads * SETTINGS.diffusion_steps and stats.drafter_forwards > 0
    assert calls.count("conditions") == heads
    assert apart(got, want) < CLOSE
    assert compiled_mode(draft) is None  # the draft followed its target, whatever its own switch says


def test_one_graph_serves_every_token_count_cfg_scale_and_temperature():
    """A step's row count changes along MAR's schedule and the linear CFG changes the scale every step: none of
    it compiles the head again, nor another generation's scale, temperature or batch. The transformer call's
    known-token count changes every step too: its second count compiles the graph for all later ones, and the
    first new batch size one for every batch."""
    compiled = compile_steps(tiny_mar(1), "on")
    run(compiled, (1, 2))  # compiles the CFG variants, if no earlier test did
    graphs = unique_graphs()
    run(compiled, (0, 1, 3, 2, 1), replace(SETTINGS, cfg_scale=2.0, temperature=0.7, num_iter=6), seed=3)
    assert unique_graphs() <= graphs + 1  # at most the transformer's graph for any batch
    graphs = unique_graphs()
    run(compiled, (2,) * 7, replace(SETTINGS, cfg_schedule="constant", num_iter=8), seed=4)  # rows no other test makes
    assert unique_graphs() == graphs


def test_the_switch_reaches_mars_head_and_auto_waits_for_the_gpu_check():
    mar = tiny_mar(0)
    assert compiled_mode(compile_steps(mar, "on")) == "default"
    assert compiled_mode(compile_steps(mar, "auto")) is None  # no gain on the CPU; CUDA not compared yet
    assert compiled_mode(compile_steps(mar, "off")) is None
    student = torch.nn.Module()
    student.kind, student.what = "few-step", "a Distilled Decoding student"
    with pytest.raises(FastARError, match="token, VAR and MAR models; this is a Distilled Decoding student"):
        compile_steps(student, "on")
