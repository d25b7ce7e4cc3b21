"""One switch for fast decode steps: a token model whose sessions run their ``forward`` through ``torch.compile``.

A session's forward keeps its shapes for a whole generation (static KV cache, one window width: 1 token for
``ar``, W for Jacobi windows, gamma + 1 for drafter chains), so each width compiles once, on first use, and
every later generation of the same batch reuses it; ZipAR's ``forward_at``, whose feed count changes as rows
start and finish, is given a few bucketed counts (samplers/token_loops/zipar.py). The kernels fuse the norms, RoPE and the
MLP gates and drop PyTorch's per-op Python dispatch, which is most of a small model's step on a CPU. On CUDA the
mode is 'reduce-overhead': each step is replayed as a CUDA graph, which needs the KV caches at fixed addresses
(compiled_session.py). Same tokens as eager for the same seed: tests/test_compiled.py on the CPU; on CUDA, the
GPU check (commands/gpu_check.py: LlamaGen and Lumina-mGPT layouts, ar and sjd, exact), which is why ``auto``
compiles there too.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import itertools
import threading
import time
import warnings
import weakref

import torch

from ...errors import FastARError, FastARWarning
from ...interrupts import can_interrupt, check_interrupt
from .compiled_session import StaticBuffers, compiled_start
from .streaming import is_streaming

# widths a model meets: prefill-free steps of 1, the windows a session or the profiler asks for, per batch
COMPILED_SHAPES = 64
# the session methods that run through torch.compile: every decoder's forward, ZipAR's feeds anywhere, draft trees
COMPILED_METHODS = ("forward", "forward_at", "forward_tree")
# device types where compiled steps are proven to give eager's tokens: the CPU in tests/test_compiled.py, CUDA in
# the GPU check (H200, torch 2.11: ar and sjd on LlamaGen and Lumina-mGPT layouts, fp32 greedy, exact); elsewhere
# (mps, ...) "auto" leaves steps eager
PROVEN_DEVICES = ("cpu", "cuda")
# where "auto" compiles each kind of model's steps: a token model's on the proven devices; MAR's and VAR's nowhere
# yet: on the CPU they give eager's tokens (tests/test_head_steps.py, test_var.py) but little or no speed (matmuls
# are the time there), and on CUDA, where eager launches are the time, the GPU check has not compared them yet
AUTO_DEVICES = {"token-ar": PROVEN_DEVICES, "masked-ar": (), "next-scale": ()}
SWITCH = ("auto", "on", "off")
CUDA_GRAPHS = "reduce-overhead"  # torch.compile's mode that replays each step as a CUDA graph (CUDA's default)
COMPILE_MODES = ("default", CUDA_GRAPHS, "max-autotune", "max-autotune-no-cudagraphs")
GRAPH_MODES = (CUDA_GRAPHS, "max-autotune")  # the modes that replay CUDA graphs: static caches, copied outputs
POLL_S = 0.1  # how often Cancel is checked while a first call compiles
# torch >= 2.6 lets a call check only the guards that tell its graphs apart (CompiledStep); older torch checks all
CAN_SKIP_GUARDS = "skip_guard_eval_unsafe" in inspect.signature(getattr(torch.compiler, "set_stance", len)).parameters


def compile_steps(model, when: str = "on", mode: str | None = None):
    """Set ``model``'s compile switch (in place, returns ``model``). ``when``: 'on' (every device), 'auto' (the
    device types in AUTO_DEVICES for its kind) or 'off'; it is read at each session start, since ComfyUI moves a model
    between devices. ``mode``: torch.compile's; default 'reduce-overhead' (CUDA graphs) on CUDA, 'default'
    elsewhere. The first generation of each shape pays the compilation (seconds to a minute). A VAR model compiles
    each scale's forward like a token model's step (its session's caches static, var/model.py), a MAR model its
    transformer call and its diffusion head's reverse steps (samplers/masked_loops/masked.py, head_steps.py); DD students have
    no steps to compile: 'on' refuses them, 'auto' and 'off' leave them as they are."""
    problem = switch_error(when)
    if problem:
        raise FastARError(problem)
    kind = getattr(model, "kind", "token-ar")
    if kind == "masked-ar":  # read by samplers/masked_loops/masked.py's guides
        model.compile_switch, model.compile_mode = when, mode
        return model
    if kind not in AUTO_DEVICES:
        if when == "on":
            raise FastARError(f"compiled steps are for token, VAR and MAR models; this is {model.what}")
        return model
    if not hasattr(model, "compile_switch"):
        eager_start = model.start

        def start(*args, **kwargs):
            step_mode = compiled_mode(model)
            if not step_mode:  # eager now (streaming, or another device): the graphs' caches would sit idle
                release_static_buffers(model)
                return eager_start(*args, **kwargs)
            with compiled_start(static_buffers(model) if step_mode in GRAPH_MODES else None):
                session = eager_start(*args, **kwargs)
            allow_shapes()
            for method in COMPILED_METHODS:
                if hasattr(session, method):
                    step = compiled_forward(type(session), step_mode, method)
                    setattr(session, method, BoundStep(step, weakref.ref(session)))
            return session

        model.start = start
    model.compile_switch, model.compile_mode = when, mode
    return model


# the mode of steps that follow a session's compiled forward but update state in place (no CUDA graphs for them)
WITHOUT_GRAPHS = {CUDA_GRAPHS: "default", "max-autotune": "max-autotune-no-cudagraphs"}


def without_graphs(mode: str) -> str:
    """``mode`` without CUDA graphs: for steps that update state in place or whose shapes change every call."""
    return WITHOUT_GRAPHS.get(mode, mode)


def following_mode(forward) -> str | None:
    """The torch.compile mode for a step that follows ``forward`` (a session's forward): the forward's, without
    CUDA graphs, while it runs compiled; None (eager) where it is not compiled or fell back to eager (a machine
    that cannot compile says so once, not once per step)."""
    if not runs_compiled(forward):
        return None
    return without_graphs(forward.step.mode)


def runs_compiled(step) -> bool:
    """Whether ``step`` (a session's forward or forward_at) runs compiled: not eager, not fallen back to eager."""
    return isinstance(step, BoundStep) and step.step.failure is None


def compile_like(model, session) -> None:
    """``model``'s steps compiled exactly when ``session``'s are, in the same mode: a drafter follows its target
    (eager, a small drafter's chain of forwards would cost more than the target's compiled one on a GPU)."""
    forward = getattr(session, "forward", None)
    if isinstance(forward, BoundStep):
        compile_steps(model, "on", forward.step.mode)
    elif hasattr(model, "compile_switch"):
        compile_steps(model, "off")


def allow_shapes() -> None:
    """Let a compiled step keep a graph for each of COMPILED_SHAPES shapes (dynamo's default is 8, after which it
    runs eagerly without a word). Recent torch keeps dynamo's settings per thread and asyncio task (ComfyUI runs
    each node in its own task), so this is set where steps run: at each session start and in the compile worker."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # torch < 2.7: the latter
    setattr(config, name, max(getattr(config, name), COMPILED_SHAPES))


def switch_error(when: str) -> str | None:
    """What is wrong with a compile setting (None: nothing); the nodes check it before a run."""
    return None if when in SWITCH else f"unknown compile setting '{when}': choose one of {', '.join(SWITCH)}"


def compiled_mode(model) -> str | None:
    """The torch.compile mode ``model``'s next session steps with on its current device; None: eager (also while
    some of its weights stream from host memory: the copies would sit inside the graphs, for no gain)."""
    when = getattr(model, "compile_switch", "off")
    device = model.device.type
    auto_devices = AUTO_DEVICES[getattr(model, "kind", "token-ar")]
    if when == "off" or (when == "auto" and device not in auto_devices) or is_streaming(model):
        return None
    return model.compile_mode or (CUDA_GRAPHS if device == "cuda" else "default")


def static_buffers(model) -> StaticBuffers:
    """The caches ``model``'s CUDA-graph sessions reuse (compiled_session.py), made on first use."""
    if getattr(model, "static_buffers", None) is None:
        model.static_buffers = StaticBuffers()
    return model.static_buffers


def release_static_buffers(model) -> None:
    """Free the caches ``model``'s CUDA-graph sessions keep (when the model leaves the GPU: ComfyUI's offload);
    the next session makes new ones, and its graphs re-record once."""
    model.static_buffers = None


@dataclasses.dataclass(frozen=True)
class BoundStep:
    """A session's compiled forward. It holds its session weakly: a strong reference (the session holding a
    callable that holds the session) would keep every finished session, KV caches and all, until Python's
    cycle collector happened to run."""

    step: "CompiledStep"
    session: weakref.ref
    serial: int = dataclasses.field(default_factory=itertools.count().__next__)  # never reused, unlike an id()

    def __call__(self, *args, **kwargs):
        return self.step(self.session(), *args, caller=self.serial, **kwargs)


def compiled_forward(session_class: type, mode: str, method: str = "forward") -> "CompiledStep":
    """One compiled step per session class, mode and method, shared by every session (and model) of that class."""
    return _compiled_method(session_class, mode, method)


@functools.cache
def _compiled_method(session_class: type, mode: str, method: str) -> "CompiledStep":
    return CompiledStep(getattr(session_class, method), mode)


@functools.cache
def compiled_function(function, mode: str, dynamic: bool | None = False) -> "CompiledStep":
    """``function(state, *tensors)`` compiled once per mode, for every state. ``dynamic=None``: dynamic where a
    later call differs (dynamo's automatic dynamic), for a decoder's loop step (loop_step.py), so that a slider's
    new cfg scale or temperature reuses its graph; False (a model's step, an EAGLE head's): specialised on every
    number it reads (a layer's head counts made symbolic would break its graph at attention)."""
    return CompiledStep(function, mode, dynamic=dynamic)


class CompiledStep:
    """``forward`` through torch.compile; where compiling fails on this machine (no C++ compiler for the CPU
    kernels, an unsupported platform or op) it warns once and runs eagerly from then on: same tokens, eager's
    speed. A call that fails eagerly too raises eager's error, so mistakes are not hidden behind compiling.

    A shape's first call compiles (seconds to a minute) without passing a point where the run could stop, so
    where a run can be cancelled (interrupts.py) that call runs in a worker thread while the caller keeps
    checking: Cancel returns at once, and the abandoned compilation finishes in the background (the next first
    call waits for it, cancellable too).

    Dynamo checks its guards before every call: the type, identity or value of every object the step reads, the
    model's modules and the session's numbers included (about a millisecond per call for a 32-layer model on a
    slow CPU: on a GPU, idle time between CUDA graph replays wherever a decoder waits for each step's tokens). A
    call that repeats the previous one (the same session, argument shapes and dtypes) evaluates only the guards
    that tell its graphs apart (``skip_guard_eval_unsafe``: every tensor's shape, dtype and device, and whatever
    made a graph compile before): nothing else it reads changes within a session (shapes stay put, numbers are
    fixed at start), and dynamo tries the graph the previous call ran first. Any other call, a session's first
    of each shape included, is guarded in full."""

    def __init__(self, forward, mode: str, dynamic: bool | None = False):
        self.eager, self.compiled, self.mode = forward, torch.compile(forward, mode=mode, dynamic=dynamic), mode
        self.failure: str | None = None
        self.shapes_run: set = set()  # argument shapes that have run: their graph exists
        self.compiling = threading.Lock()  # held while a first call runs in a worker thread
        self.last_call = None  # (caller, argument shapes) of the last call that ran

    def __call__(self, session, *args, caller: int | None = None, **kwargs):
        if self.failure is not None:
            return self.eager(session, *args, **kwargs)
        shape = tuple((a.shape, a.dtype, a.device) if torch.is_tensor(a) else a for a in args)
        repeat = self.repeats_last_call(caller, shape)
        call = functools.partial(self.compiled_or_eager, session, *args, repeat=repeat, **kwargs)
        out = call() if shape in self.shapes_run or not can_interrupt() else self.in_worker(call, args)
        self.shapes_run.add(shape)
        self.last_call = (caller, shape)
        return out

    def repeats_last_call(self, caller: int | None, shape: tuple) -> bool:
        """Whether this call may check only the guards that tell graphs apart (see the class doc)."""
        return (CAN_SKIP_GUARDS and _skip_repeat_guards.get() and caller is not None
                and (caller, shape) == self.last_call)

    def compiled_or_eager(self, session, *args, repeat: bool = False, **kwargs):
        try:
            graphs, t0 = unique_graphs(), time.perf_counter()
            if self.mode in GRAPH_MODES:
                torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs are copies (below)
            out = self.guarded_call(session, args, kwargs, repeat)
            if self.mode in GRAPH_MODES:
                out = copied(out)
            if unique_graphs() != graphs:  # this call compiled a new shape: its time is compilation
                COMPILE_CLOCK.seconds += time.perf_counter() - t0
            return out
        except Exception as error:  # noqa: BLE001 - whatever compiling raises, eager is the answer
            result = self.eager(session, *args, **kwargs)
            first_line = (str(error).strip().splitlines() or [""])[0]
            self.failure = f"{type(error).__name__}: {first_line[:300]}"
            compiler = "compiler" in self.failure.lower() or "g++" in self.failure  # what the advice can mend
            warnings.warn(f"compiled steps are off: torch.compile failed on this machine ({self.failure}); "
                          "decoding runs eagerly (same images, without the speed-up). "
                          + ("Install a C++ compiler (g++) for CPU kernels, or turn" if compiler else "Turn")
                          + " the compile switch off to skip the attempt", FastARWarning, stacklevel=3)
            return result

    def guarded_call(self, session, args, kwargs, repeat: bool):
        if not repeat:
            return self.compiled(session, *args, **kwargs)
        try:
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                return self.compiled(session, *args, **kwargs)
        except RuntimeError as error:  # a tensor it reads changed since the last call: no graph fits (nothing ran)
            if "skip_guard_eval_unsafe" not in str(error):
                raise
            return self.compiled(session, *args, **kwargs)

    def in_worker(self, call, args):
        while not self.compiling.acquire(timeout=POLL_S):
            check_interrupt()
        result: dict = {}
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        device = next((a.device for a in args if torch.is_tensor(a) and a.device.type == "cuda"), None)

        def work():
            allow_shapes()
            try:  # grad and inference mode (ComfyUI runs nodes under it) and the CUDA device are per thread
                with torch.inference_mode(inference), torch.set_grad_enabled(grad), \
                        (torch.cuda.device(device) if device else contextlib.nullcontext()):
                    result["out"] = call()
            except BaseException as error:  # noqa: BLE001 - raised in the caller below
                result["error"] = error
            finally:
                self.compiling.release()

        worker = threading.Thread(target=work, name="fastar-compile", daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(POLL_S)
            if worker.is_alive():
                check_interrupt()
        if "error" in result:
            raise result["error"]
        return result["out"]


_skip_repeat_guards: contextvars.ContextVar[bool] = contextvars.ContextVar("fastar_skip_repeat_guards", default=True)


@contextlib.contextmanager
def guards_in_full():
    """Compiled calls made inside check every guard, repeats included (the profile times what skipping saves)."""
    token = _skip_repeat_guards.set(False)
    try:
        yield
    finally:
        _skip_repeat_guards.reset(token)


def copied(out):
    """A step's outputs (a dataclass of tensors) copied out of the CUDA graph's pool, which the next replay
    overwrites while decoders still read the previous window's logits."""
    tensors = {f.name: getattr(out, f.name) for f in dataclasses.fields(out)}
    return dataclasses.replace(out, **{name: t.clone() for name, t in tensors.items() if torch.is_tensor(t)})


@dataclasses.dataclass
class CompileClock:
    """Seconds spent compiling steps so far in this process (decode() reports a generation's share apart from
    its decoding time, so that a first run's compilation does not read as a slow decoder)."""

    seconds: float = 0.0


COMPILE_CLOCK = CompileClock()


def unique_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def graph_breaks() -> dict[str, int]:
    """The graph breaks dynamo has met in this process, by reason. A compiled step should have none: each one
    splits the step into graphs with Python between them (and its CUDA graph into several)."""
    return dict(torch._dynamo.utils.counters["graph_break"])
