"""A decoder layer's matrix products with their neighbours fused in, one Triton kernel each: the RMSNorm before a
product as its prologue, SwiGLU after the joined gate/up product and the residual add after the output products as
epilogues. A decode step's layer then launches four kernels around its attention where torch launches about ten;
on a GPU each launch inside a CUDA graph still leaves the GPU idle for microseconds, which at 32 layers is a
sixth of a 7B step (profiling.md, "On a GPU").

    fused_linear(x, w)                                  x @ w.T
    fused_linear(x, w, norm=(g, eps))                   rmsnorm(x) * g @ w.T   (transformer.RMSNorm's rounding)
    fused_linear(x, w13, norm=(g, eps), swiglu=True)    silu(a @ gate.T) * (a @ up.T), w13 = [gate; up] joined
    fused_linear(x, w, residual=r)                      r + x @ w.T

The GPU check times it against inductor's compiled layer (``--probe fused-layer``) before any model runs on it.
It applies on a CUDA device with Triton in bf16 or fp16, where the tiles divide the weight (``fused_applies``);
``TRITON_INTERPRET=1`` runs it on the CPU (the tests: fp16 only, the interpreter has no bf16).
"""
from __future__ import annotations

import torch

from .w8_matmul import HALF_DTYPES, INTERPRETED, tiles, triton

if triton is not None:
    import triton.language as tl


def block_sizes(rows: int, out_features: int, in_features: int) -> dict | None:
    """Tiles for ``rows`` input rows (a decode step's few, a window's many), or None where they do not divide the
    weight. Only rows are masked in the kernel."""
    block_m, block_n, block_k = (16, 64, 128) if rows <= 16 else (64, 64, 64)
    if out_features % block_n or in_features % block_k:
        return None
    return tiles(block_m, block_n, block_k)


def fused_applies(x: torch.Tensor, weight: torch.Tensor, swiglu: bool = False) -> bool:
    if triton is None or x.dtype not in HALF_DTYPES or not (x.is_cuda or INTERPRETED) or x.numel() == 0:
        return False
    out_features = weight.shape[0] // (2 if swiglu else 1)
    return block_sizes(x.numel() // x.shape[-1], out_features, x.shape[-1]) is not None


def fused_linear(x: torch.Tensor, weight: torch.Tensor, *, norm: tuple[torch.Tensor, float] | None = None,
                 swiglu: bool = False, residual: torch.Tensor | None = None, blocks: dict | None = None
                 ) -> torch.Tensor:
    """The product of ``x`` [..., in] and ``weight`` [out, in] (``swiglu``: [2 * out, in], gate rows first) in
    ``x``'s dtype, with the optional RMSNorm prologue (``norm``: its weight [in] and eps), SwiGLU and residual
    ([..., out]) epilogues. Only where ``fused_applies``; ``blocks``: other tiles than ``block_sizes``'s."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    m, k = rows.shape
    n = weight.shape[0] // (2 if swiglu else 1)
    blocks = blocks or block_sizes(m, n, k)
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    gain, eps = norm if norm is not None else (weight, 0.0)  # unread without NORM
    added = residual.reshape(m, n).contiguous() if residual is not None else out
    grid = (n // blocks["BLOCK_N"], triton.cdiv(m, blocks["BLOCK_M"]))
    _fused_linear_kernel[grid](rows, gain, weight, added, out, m, n, k, eps, NORM=norm is not None,
                               SWIGLU=swiglu, RESIDUAL=residual is not None, **blocks)
    return out.reshape(*x.shape[:-1], n)


if triton is not None:
    @triton.jit
    def _fused_linear_kernel(x_ptr, gain_ptr, w_ptr, residual_ptr, out_ptr, M, N, K, eps, NORM: tl.constexpr,
                             SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """One program: BLOCK_M rows by BLOCK_N outputs over all of K. With NORM it first reads its rows once for
        their root mean square (a few KB: the weights' bytes are the cost), then rounds as RMSNorm does: the
        normalised rows to the input dtype, then times the gain, rounded again."""
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows[:, None] < M
        dtype = out_ptr.dtype.element_ty
        if NORM:
            squares = tl.zeros([BLOCK_M], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=row_ok, other=0.0).to(tl.float32)
                squares += tl.sum(x * x, axis=1)
            inv_rms = 1.0 / tl.sqrt(squares / K + eps)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=row_ok, other=0.0)
            if NORM:
                normed = (x.to(tl.float32) * inv_rms[:, None]).to(dtype)
                x = (normed.to(tl.float32) * tl.load(gain_ptr + ks)[None, :].to(tl.float32)).to(dtype)
            acc += tl.dot(x, tl.trans(tl.load(w_ptr + cols[:, None] * K + ks[None, :])))
            if SWIGLU:
                up += tl.dot(x, tl.trans(tl.load(w_ptr + (cols[:, None] + N) * K + ks[None, :])))
        if SWIGLU:  # rounded as torch's silu(gate) * up on half-precision products
            gate = acc.to(dtype).to(tl.float32)
            acc = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32) * up.to(dtype).to(tl.float32)
        if RESIDUAL:  # r + (x @ w.T), the product rounded first as torch's is
            acc = acc.to(dtype).to(tl.float32) + tl.load(residual_ptr + rows[:, None] * N + cols[None, :],
                                                         mask=row_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(dtype), mask=row_ok)
