"""The fused 8-bit matmul (model_loaders/shared/kernels/w8_matmul.py): the Triton kernel itself, run on this CPU by
Triton's interpreter (``TRITON_INTERPRET=1``, in a subprocess since Triton reads it at import), against the
dequantised product; and where it applies. The interpreter has no bf16, so bf16 is the GPU check's (``--probe
w8``)."""
import os
import subprocess
import sys

import pytest
import torch

from fastar.model_loaders.shared.kernels.w8_matmul import block_sizes, fused_matmul_applies

triton = pytest.importorskip("triton", reason="Triton is a test requirement (.ci/requirements-dev.txt)")

INTERPRETED_CHECKS = r"""
import torch, torch.nn.functional as F
from fastar.model_loaders.shared.quantized import QuantizedLinear, dequantize, quantize_rows
from fastar.model_loaders.shared.kernels.w8_matmul import INTERPRETED, fused_matmul, fused_matmul_applies, tiles

assert INTERPRETED
g = torch.Generator().manual_seed(0)
worst = 0.0
# rows: a decode step's few (1, 3), a full small tile (16), the window tiles (17, 40: rows masked in the last tile);
# in_features 96: the K tile shrinks to 32; x of three dims as the blocks give it
for fmt in ("int8", "fp8"):
    for rows in (1, 3, 16, 17, 40):
        for in_features, bias in ((256, True), (96, False)):
            weight = torch.randn(64, in_features, generator=g) * torch.rand(64, 1, generator=g)
            codes, scale = quantize_rows(weight, fmt)
            b = torch.randn(64, generator=g).half() if bias else None
            x = torch.randn(2, rows, in_features, generator=g).half()
            assert fused_matmul_applies(x, codes)
            got = fused_matmul(x, codes, scale, b)
            want = F.linear(x.float(), dequantize(codes, scale, torch.float32), None if b is None else b.float())
            assert got.dtype == torch.float16 and got.shape == want.shape
            worst = max(worst, ((got.float() - want).abs().max() / want.abs().max()).item())
assert not fused_matmul_applies(torch.zeros(0, 256).half(), codes)  # no rows: no kernel launch (an empty grid)
# other tiles (the GPU check times a few): the same product; rows past a 64-row tile and one that covers them all
codes, scale = quantize_rows(torch.randn(64, 256, generator=g), "int8")
x = torch.randn(70, 256, generator=g).half()
default = fused_matmul(x, codes, scale, None)
for shape in ((64, 64, 128), (16, 64, 64), (64, 32, 256)):
    assert ((fused_matmul(x, codes, scale, None, tiles(*shape)).float() - default.float()).abs().max()
            <= 1e-3 * default.float().abs().max())
# the layer takes the kernel in half precision, and gives the dequantised product's values
layer = QuantizedLinear(torch.nn.Linear(256, 64).half(), "int8")
x = torch.randn(5, 256, generator=g).half()
fused = layer(x)
assert torch.equal(fused, fused_matmul(x, layer.weight, layer.weight_scale, layer.bias))
plain = F.linear(x.float(), layer.weight_for(x).float(), layer.bias.float())
print(worst, ((fused.float() - plain).abs().max() / plain.abs().max()).item())
"""


def test_the_kernel_gives_the_dequantised_product_in_fp16():
    """Against the fp32 product of the same codes: within fp16's output rounding (a relative 2^-11 of the largest
    value, with fp32 accumulation), for every tile shape, masked rows, bias or none, int8 and fp8 codes."""
    tests = os.path.dirname(__file__)
    env = os.environ | {"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
                        "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-c", INTERPRETED_CHECKS], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    kernel_error, layer_error = map(float, r.stdout.split())
    assert kernel_error < 1e-3 and layer_error < 1e-3


def test_it_applies_on_a_gpu_in_half_precision_only():
    codes = torch.zeros(64, 256, dtype=torch.int8)
    x = torch.zeros(4, 256, dtype=torch.float16)
    assert not fused_matmul_applies(x, codes)  # this CPU, not interpreted: the dequantised path
    assert not fused_matmul_applies(x.float(), codes)  # fp32 keeps the exact dequantised products


def test_its_tiles_divide_the_weight_or_it_steps_aside():
    """The K tile halves until it divides in_features (LlamaGen-XL's 3456 takes 128); an output count that 32 does
    not divide, or an odd in_features, leaves the dequantised path."""
    assert block_sizes(4, 4096, 4096)["BLOCK_K"] == 256
    assert block_sizes(4, 4096, 11008)["BLOCK_K"] == 256
    assert block_sizes(4, 1280, 3456)["BLOCK_K"] == 128
    assert block_sizes(64, 4096, 4096) == {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4,
                                           "num_stages": 4}
    assert block_sizes(4, 40, 256) is None
    assert block_sizes(4, 64, 100) is None
