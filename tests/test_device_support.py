"""What FastAR needs from PyTorch and picks for a device: the minimum PyTorch said before anything loads, and
``auto``'s precision on GPUs without bf16 in hardware (fp16, as ComfyUI picks; PyTorch's is_bf16_supported()
counts software emulation, which made pre-Ampere cards run an emulated bf16)."""
import re

import pytest
import torch

from fastar.errors import FastARError
from fastar.model_loaders import load_ar_model
from fastar.pipeline import resolve_dtype
from fastar.torch_version import check_torch_version


@pytest.mark.parametrize("capability, dtype", [((7, 5), torch.float16), ((6, 1), torch.float16),
                                               ((8, 0), torch.bfloat16), ((9, 0), torch.bfloat16)])
def test_auto_precision_follows_the_hardware(monkeypatch, capability, dtype):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)  # emulation counted
    assert resolve_dtype("auto", torch.device("cuda")) == dtype
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("bf16", torch.device("cuda")) == torch.bfloat16  # asked for: given


@pytest.mark.parametrize("version", ["2.4.1+cu121", "1.13.1", "2.0.0"])
def test_an_old_pytorch_is_refused_with_what_to_do(version, monkeypatch):
    with pytest.raises(FastARError, match=f"FastAR needs PyTorch 2.5 or newer; this is {re.escape(version)}. Update PyTorch"):
        check_torch_version(version)
    monkeypatch.setattr(torch, "__version__", version)
    with pytest.raises(FastARError, match="needs PyTorch 2.5"):
        load_ar_model("no-such-model.safetensors")  # said before the file is looked for


@pytest.mark.parametrize("version", ["2.5.0", "2.13.0+cpu", "2.11.0+cu130", "3.0.0a0"])
def test_a_recent_pytorch_passes(version):
    check_torch_version(version)
