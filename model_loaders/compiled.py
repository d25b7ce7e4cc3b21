"""One switch for fast decode steps: a token model whose sessions run their ``forward`` through ``torch.compile``.

A session's forward keeps its shapes for a whole generation (static KV cache, one window width: 1 token for
``ar``, W for Jacobi windows, gamma + 1 for drafter chains), so each width compiles once, on first use, and
every later generation of the same batch reuses it. The kernels fuse the norms, RoPE and the MLP gates and
drop PyTorch's per-op Python dispatch, which is most of a small model's step on a CPU. On CUDA the mode is
'reduce-overhead' (CUDA graphs: one launch per step) — not yet measured on a GPU. Same tokens as eager for the
same seed: tests/test_compiled.py.
"""
from __future__ import annotations

import functools

import torch

from ..errors import FastARError

# widths a model meets: prefill-free steps of 1, the windows a session or the profiler asks for, per batch
COMPILED_SHAPES = 64


def compile_steps(model, mode: str | None = None):
    """Make ``model``'s sessions compile their step (in place, returns ``model``). ``mode``: torch.compile's;
    default 'reduce-overhead' on CUDA, 'default' elsewhere. The first generation of each shape pays the
    compilation (seconds to a minute); nothing else about the model changes."""
    if getattr(model, "kind", "token-ar") != "token-ar":
        raise FastARError(f"compiled steps are for token models (their static-cache step); this is {model.what}")
    if getattr(model, "compiled_mode", None):
        return model
    mode = mode or ("reduce-overhead" if model.device.type == "cuda" else "default")
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, COMPILED_SHAPES)
    eager_start = model.start

    def start(*args, **kwargs):
        session = eager_start(*args, **kwargs)
        session.forward = functools.partial(compiled_forward(type(session), mode), session)
        return session

    model.start, model.compiled_mode = start, mode
    return model


@functools.cache
def compiled_forward(session_class: type, mode: str):
    """One compiled step per session class and mode, shared by every session (and model) of that class."""
    return torch.compile(session_class.forward, mode=mode, dynamic=False)
