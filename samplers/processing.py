"""The one logits-processing pipeline every decoder uses, and the seeded sampling primitives.

CFG combination -> temperature -> top-k -> top-p -> softmax. Draft and target distributions must
come out of this same function, or acceptance ratios are meaningless.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch

from ..errors import FastARError
from ..model_loaders.shared.protocol import ModelOutput


@dataclass(frozen=True)
class SamplingSettings:
    cfg_scale: float = 2.0  # LlamaGen's FID setting; 1.0 disables guidance (and its batch rows)
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off

    @property
    def use_cfg(self) -> bool:
        return self.cfg_scale != 1.0

    def validate(self) -> "SamplingSettings":
        if not 0.0 <= self.cfg_scale <= 100.0:
            raise FastARError(f"cfg scale {self.cfg_scale} is out of range: use 0..100 (1.0 turns guidance off)")
        if not 0.0 <= self.temperature <= 100.0:
            raise FastARError(f"temperature {self.temperature} is out of range: use 0..100 (0 = greedy)")
        if self.top_k < 0:
            raise FastARError(f"top-k {self.top_k} is negative: use 0 (off) or a positive number of codes")
        if not 0.0 < self.top_p <= 1.0:
            raise FastARError(f"top-p {self.top_p} is out of range: use a value in (0, 1] (1.0 = off)")
        return self


@dataclass(frozen=True)
class Pipeline:
    """``SamplingSettings`` as ``probabilities`` reads them, their branches decided beforehand. A compiled loop step
    (loop_step.py) that holds one specialises on the booleans and top-k alone and takes the cfg scale, the
    temperature and top-p as inputs, so a slider's new value reuses its graph (comparing those floats inside
    the step would tie the graph to each value)."""

    cfg_scale: float
    temperature: float
    top_k: int
    top_p: float
    greedy: bool
    nucleus: bool  # top-p on

    @classmethod
    def of(cls, settings: "SamplingSettings | Pipeline") -> "Pipeline":
        if isinstance(settings, Pipeline):
            return settings
        return cls(settings.cfg_scale, settings.temperature, settings.top_k, settings.top_p,
                   greedy=settings.temperature == 0.0, nucleus=settings.top_p < 1.0)


DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass
class NonFiniteWatch:
    """Whether any logits of a generation were NaN or inf, kept on the device (a check per forward would cost a
    host sync each); read once, after the generation."""

    seen: torch.Tensor | None = None

    def note(self, logits: torch.Tensor) -> None:
        bad = ~torch.isfinite(logits).all()
        self.seen = bad if self.seen is None else self.seen | bad


_watch: contextvars.ContextVar[NonFiniteWatch | None] = contextvars.ContextVar("fastar_non_finite", default=None)


@contextlib.contextmanager
def finite_logits(dtype: torch.dtype):
    """Around a generation: if any logits were not finite (fp16's range overflowing inside the model, most
    likely), a clear error after it. ``sample`` keeps every code in range meanwhile, so nothing asserts on the
    device."""
    watch = NonFiniteWatch()
    token = _watch.set(watch)
    try:
        yield
    finally:
        _watch.reset(token)
    if watch.seen is not None and bool(watch.seen):
        name = DTYPE_NAMES.get(dtype, str(dtype))
        advice = ("fp16's range overflowed inside the model: load it in bf16 where the GPU supports it, else fp32"
                  if dtype == torch.float16 else "load it in fp32; if fp32 fails too, the checkpoint is damaged: "
                  "download it again")
        raise FastARError(f"the model's next-token logits were not finite (NaN or inf) in {name}, so the image "
                          f"would be noise: {advice} (--dtype on the command line, the loader's dtype input in "
                          "ComfyUI)")


def current_watch() -> NonFiniteWatch | None:
    """The generation's watch, for code that cannot read a context variable (a compiled loop step: dynamo
    breaks its graph there) and passes it to ``probabilities`` itself."""
    return _watch.get()


_CURRENT = object()  # probabilities' default watch: the generation's


def guided_logits(out: ModelOutput, settings: SamplingSettings | Pipeline) -> torch.Tensor:
    """The logits after classifier-free guidance, in fp32: what ``probabilities`` processes (and what a greedy
    drafter ranks its codes by)."""
    logits = out.cond.float()
    if out.uncond is not None:
        logits = out.uncond.float() + (logits - out.uncond.float()) * Pipeline.of(settings).cfg_scale
    return logits


def probabilities(out: ModelOutput, settings: SamplingSettings | Pipeline, watch=_CURRENT) -> torch.Tensor:
    """Processed next-token distributions ``[..., V]`` in fp32. ``watch``: where non-finite logits are noted
    (default: the generation's; None: nowhere, for logits noted once already)."""
    settings = Pipeline.of(settings)
    logits = guided_logits(out, settings)
    watch = _watch.get() if watch is _CURRENT else watch
    if watch is not None:
        watch.note(logits)
    if settings.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / settings.temperature
    if 0 < settings.top_k < logits.shape[-1]:
        kth = torch.topk(logits, settings.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))  # ties with the k-th stay, as upstream
    if settings.nucleus:
        ordered = torch.sort(logits, dim=-1, descending=True).values
        ordered_probs = ordered.softmax(-1)
        mass_before = ordered_probs.cumsum(-1) - ordered_probs  # keeps the token that crosses top_p
        kept = (mass_before <= settings.top_p).sum(-1, keepdim=True).clamp_(min=1)  # a prefix of the order
        # ties with the last kept code stay, as top-k's do (whatever order an unstable sort gave them, so every
        # device keeps the same codes); a cut by value, not a scatter back (compiled for a CPU, 5x slower)
        logits = logits.masked_fill(logits < ordered.gather(-1, kept - 1), float("-inf"))
    return logits.softmax(-1)


def sample(dist: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One code per distribution: ``[..., V] -> [...]``, by the inverse CDF (35x faster than multinomial
    on a 2-core CPU at 32 x 16384). u lies in (0, total]: the first code whose cumulative mass reaches u always has
    mass, whatever the rounding (a code of zero mass never is the first to reach a value)."""
    flat = dist.reshape(-1, dist.shape[-1])
    cdf = flat.cumsum(-1)
    u = (1.0 - uniform((flat.shape[0], 1), generator)) * cdf[:, -1:]
    # a NaN distribution finds no code (index V): keep it in range, finite_logits reports it after the generation
    return torch.searchsorted(cdf, u).clamp_(max=flat.shape[-1] - 1).view(dist.shape[:-1])


def uniform(shape, generator) -> torch.Tensor:
    """Uniform [0, 1) numbers from ``generator``: a torch.Generator, or the draws a compiled loop step was
    given (drawn_noise.py)."""
    if isinstance(generator, torch.Generator):
        return torch.rand(shape, generator=generator, device=generator.device)
    return generator.rand(shape)


def random_codes(vocab: int, shape, generator) -> torch.Tensor:
    """Codes uniform over ``vocab``, from a torch.Generator or a compiled loop step's draws, as ``uniform``."""
    if isinstance(generator, torch.Generator):
        return torch.randint(vocab, shape, generator=generator, device=generator.device)
    return generator.randint(vocab, shape)


_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for x in [0, 2**32) in int64, split so that no product passes 2**48."""
    hi, lo = c >> 16, c & 0xFFFF
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche mix (xor-shift-multiply; every input bit flips about half the output bits)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_key(generator: torch.Generator) -> torch.Tensor:
    """A 32-bit key for ``counter_gumbel`` (0-d int64 on the generator's device: no host sync, and a compiled loop
    step reads it as data, not as a number baked into its graph), drawn once from the generation's generator."""
    return torch.randint(0, 2**32, (), generator=generator, device=generator.device, dtype=torch.int64)


def counter_gumbel(key: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise ``[B, W, V]`` for every (row, absolute position, code): a hash of the key and
    those three counters, so the same position always gets the same noise whatever the window or the
    schedule, and memory is only that of the window."""
    B = positions.shape[0]
    dev = positions.device
    rows = torch.arange(B, device=dev).view(B, 1, 1)
    codes = torch.arange(vocab, device=dev).view(1, 1, vocab)
    h = _mix32((rows + _mul32(key.to(dev), 0x9E3779B9)) & _MASK32)  # a stream per row, then per position, then per code
    h = _mix32(h ^ (positions.unsqueeze(-1).long() & _MASK32))
    h = _mix32((h + codes * 0x9E3779B9) & _MASK32)
    u = (h.double() + 0.5) / 2.0**32  # in (0, 1), never 0 or 1
    return (-torch.log(-torch.log(u))).float()
