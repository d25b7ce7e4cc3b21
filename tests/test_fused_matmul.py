"""The fused layer products (model_loaders/shared/kernels/fused_matmul.py): the Triton kernel run on this CPU by Triton's
interpreter (``TRITON_INTERPRET=1``, in a subprocess since Triton reads it at import) against the torch ops it
replaces, each fusion alone and together; and where it applies. The interpreter has no bf16, so bf16 and the
timing are the GPU check's (``--probe fused-layer``)."""
import os
import subprocess
import sys

import pytest
import torch

from fastar.model_loaders.shared.kernels.fused_matmul import block_sizes, fused_applies

triton = pytest.importorskip("triton", reason="Triton is a test requirement (.ci/requirements-dev.txt)")

INTERPRETED_CHECKS = r"""
import json
import torch, torch.nn.functional as F
from fastar.model_loaders.shared.kernels.fused_matmul import fused_applies, fused_linear
from fastar.model_loaders.shared.transformer import RMSNorm
from fastar.model_loaders.shared.kernels.w8_matmul import INTERPRETED, tiles

assert INTERPRETED
g = torch.Generator().manual_seed(0)
half = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g) * scale).half()
errors = {}

def relative(got, want):
    assert got.dtype == torch.float16 and got.shape == want.shape, (got.shape, want.shape)
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()

def worst(name, got, want):
    errors[name] = max(errors.get(name, 0.0), relative(got, want))

# rows: a step's one and four, a window's 17 and 40 (rows masked in the last tile); x of three dims
for rows in (1, 4, 17, 40):
    x, r = half(2, rows, 128, scale=3.0), half(2, rows, 64)
    w, w13 = half(64, 128, scale=0.1), half(128, 128, scale=0.1)
    norm = RMSNorm(128, 1e-5).half()
    norm.weight.data = half(128) + 1
    normed = norm(x)
    assert fused_applies(x, w) and fused_applies(x, w13, swiglu=True)
    worst("product", fused_linear(x, w), F.linear(x, w))
    worst("norm", fused_linear(x, w, norm=(norm.weight, norm.eps)), F.linear(normed, w))
    gate, up = F.linear(normed, w13).chunk(2, dim=-1)
    worst("norm swiglu", fused_linear(x, w13, norm=(norm.weight, norm.eps), swiglu=True), F.silu(gate) * up)
    worst("residual", fused_linear(x, w, residual=r), r + F.linear(x, w))
# other tiles (the GPU check times a few): the same values
x, w = half(20, 256), half(128, 256, scale=0.1)
default = fused_linear(x, w)
for shape in ((16, 32, 64), (32, 128, 256), (64, 64, 128)):
    worst("tiles", fused_linear(x, w, blocks=tiles(*shape)), default)
print(json.dumps(errors))
"""


def test_each_fusion_gives_the_ops_it_replaces_in_fp16():
    """Within fp16's output rounding of the torch ops (the kernel rounds where they round, but sums in another
    order): the product, the RMSNorm prologue, RMSNorm + SwiGLU on joined gate/up weights, the residual epilogue, at
    a step's rows and a window's (masked), and other tiles."""
    env = os.environ | {"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", INTERPRETED_CHECKS], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    errors = eval(r.stdout.strip().splitlines()[-1])
    assert set(errors) == {"product", "norm", "norm swiglu", "residual", "tiles"}
    assert max(errors.values()) < 2e-3, errors


def test_it_applies_on_a_gpu_in_half_precision_where_its_tiles_divide():
    x = torch.zeros(4, 4096, dtype=torch.float16)
    assert not fused_applies(x, torch.zeros(4096, 4096, dtype=torch.float16))  # this CPU, not interpreted
    # a 7B layer's products and LlamaGen-XL's divide the tiles: q, k, v joined; gate, up joined (per half); down
    for rows in (4, 64):
        for out_features, in_features in ((12288, 4096), (11008, 4096), (4096, 11008), (3840, 1280), (1280, 3584)):
            assert block_sizes(rows, out_features, in_features) is not None
    assert block_sizes(4, 12288, 4096) == {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4,
                                           "num_stages": 4}
    assert block_sizes(4, 100, 4096) is None and block_sizes(4, 4096, 96) is None  # tiles that do not divide


PROBE_CHECK = r"""
import json
from fastar.commands import gpu_probes

calls = []
result = gpu_probes.probe_fused_layer("cpu", None, shape={"dim": 128, "qkv": 384, "ffn": 256}, layers=2,
                                      dtype="float16", timed=lambda work: calls.append(work()) or 1.0,
                                      compile_mode=None)
print(json.dumps({"result": result, "calls": len(calls)}))
"""


def test_the_gpu_check_probe_times_both_layers_and_compares_their_outputs():
    """The fused-layer probe on a shrunken shape, timing stubbed: both ways at a step's rows and a window's, the
    tiles that divide the shape, and the fused layers' output within fp16's rounding of torch's over 2 layers."""
    env = os.environ | {"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", PROBE_CHECK], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = eval(r.stdout.strip().splitlines()[-1].replace("null", "None"))
    result = out["result"]
    ways = ("torch compiled", "fused")
    assert set(result["ms_per_step"]) == {f"{way} rows {rows}" for way in ways for rows in (4, 64)}
    assert max(result["relative_difference"].values()) < 5e-3, result["relative_difference"]
    # 128 and 256 wide: K tiles of 256 do not divide 128, N tiles of 128 divide every output count here
    assert set(result["fused_tiles_ms"]["rows 4"]) == {"16x32x128", "16x64x128", "16x128x128", "64x64x64", "64x128x64"}
    assert out["calls"] == 2 * (2 + 5)
