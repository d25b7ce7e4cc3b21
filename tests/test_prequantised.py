"""Pre-quantised checkpoints (``python -m fastar quantize``, commands/quantize.py): every family's 8-bit copy loads
the very codes, scales and other weights that quantising at load gives, in its own format whatever was asked,
in half precision too; a Janus folder keeps its image decoder; wrong requests and interrupted writes leave a clear
message and nothing broken."""
import json
import stat
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fastar import cli
from fastar.commands import quantize
from fastar.commands.quantize import write_quantised
from fastar.errors import FastARError
from fastar.model_loaders import load_ar_model, load_image_decoder
from fastar.model_loaders.shared.demo import DEMO_AR, DEMO_MAR, DEMO_MAR_DRAFT, DEMO_TEXT, DEMO_VQ
from fastar.model_loaders.shared.quantized import STORED_FORMAT, QuantizedLinear, weight_format
from test_quantized import EVERY_FAMILY, FIXTURES

RELEASE_FILES = [FIXTURES / "llamagen_c2i" / "gpt.pt", FIXTURES / "llamagen_dd" / "student.pt",
                 FIXTURES / "mar_tiny" / "checkpoint-last.pth", FIXTURES / "var" / "var_d2.pth",
                 FIXTURES / "var_dd" / "var-d2.pth"]  # official layouts, their configs in NAME.json beside them
SOURCES = [(path, ("int8", "fp8")[i % 2]) for i, path in enumerate(EVERY_FAMILY + RELEASE_FILES)]


def bitwise_equal(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k].reshape(-1).view(torch.uint8),
                                                                              b[k].reshape(-1).view(torch.uint8))
                                      for k in a)


def weights_file(out: Path) -> Path:
    return out / quantize.WEIGHTS_FILE if out.is_dir() else out


@pytest.mark.parametrize("path, fmt", SOURCES, ids=lambda v: v.parent.name + "/" + v.name if isinstance(v, Path) else v)
def test_a_pre_quantised_checkpoint_loads_what_quantising_at_load_gives(path, fmt, tmp_path):
    """Each family and layout (FastAR's files and folders, the releases' pickles with their NAME.json configs): the
    copy holds 8-bit codes with fp32 scales for the blocks' layers, loads in its format when asked for nothing,
    and bit for bit into the model that quantising the source at load (in fp32) builds."""
    out = write_quantised(path, fmt, tmp_path / ("copy" if path.is_dir() else "copy.safetensors"))
    loaded = load_ar_model(out, device="cpu", dtype=torch.float32)
    assert weight_format(loaded) == fmt
    assert bitwise_equal(loaded.state_dict(), load_ar_model(path, fmt, device="cpu", dtype=torch.float32).state_dict())
    assert bitwise_equal(loaded.state_dict(), load_ar_model(out, fmt, device="cpu", dtype=torch.float32).state_dict())
    with safe_open(str(weights_file(out)), "pt") as f:
        assert f.metadata()[STORED_FORMAT] == fmt
        codes = [k for k in f.keys() if f"{k}_scale" in f.keys()]
        assert codes and all(f.get_slice(k).get_dtype() == {"int8": "I8", "fp8": "F8_E4M3"}[fmt] for k in codes)
        assert all(f.get_slice(f"{k}_scale").get_dtype() == "F32" for k in codes)
    assert len(codes) >= sum(isinstance(m, QuantizedLinear) for m in loaded.modules())  # joined layers: in parts
    assert stat.S_IMODE(weights_file(out).stat().st_mode) & 0o044 == 0o044  # others may read it (ComfyUI's user)
    if path.is_dir():  # tokenizer and settings files come along, the source's weights index does not
        kept = {p.name for p in path.iterdir() if p.suffix != ".safetensors" and not p.name.endswith(".index.json")}
        assert {p.name for p in out.iterdir()} == kept | {"config.json", quantize.WEIGHTS_FILE}


@pytest.mark.parametrize("path", [DEMO_AR, DEMO_TEXT], ids=["file", "folder"])
def test_a_pre_quantised_model_in_half_precision_keeps_its_codes_and_fp32_scales(path, tmp_path):
    """bf16 and fp16 loads (a folder's tensors are cast as they are read): the codes and scales as in fp32, the
    rest cast."""
    out = write_quantised(path, "int8", tmp_path / ("copy" if path.is_dir() else "copy.safetensors"))
    for dtype in (torch.bfloat16, torch.float16):
        half = load_ar_model(out, device="cpu", dtype=dtype)
        assert bitwise_equal(half.state_dict(), load_ar_model(out, device="cpu").to(dtype).state_dict())
        layers = [m for m in half.modules() if isinstance(m, QuantizedLinear)]
        assert layers and all(m.weight.dtype == torch.int8 and m.weight_scale.dtype == torch.float32 for m in layers)


def test_a_janus_folders_copy_keeps_its_image_decoder(tmp_path):
    """The VQ decoder a Janus folder carries (either layout) loads from the 8-bit copy as from the source."""
    for layout in ("janus_deepseek", "janus_transformers"):
        out = write_quantised(FIXTURES / layout, "int8", tmp_path / layout)
        assert bitwise_equal(load_image_decoder(out).state_dict(), load_image_decoder(FIXTURES / layout).state_dict())


@pytest.mark.parametrize("target, draft", [(DEMO_MAR, DEMO_MAR_DRAFT), (DEMO_AR, DEMO_AR)], ids=["mar", "small-ar"])
def test_a_pre_quantised_drafter_loads_in_its_format(target, draft, tmp_path):
    """Load Drafter's paths: a MAR draft's or a small AR drafter's 8-bit copy loads in its format, bit for bit as
    quantising at load does; the other format is refused."""
    from fastar.model_loaders.drafters.loader import drafter_weights, load_drafter

    out = write_quantised(draft, "fp8", tmp_path / "draft.safetensors")
    target = load_ar_model(target, device="cpu")
    loaded = drafter_weights(load_drafter(out, target))
    assert weight_format(loaded) == "fp8"
    assert bitwise_equal(loaded.state_dict(), drafter_weights(load_drafter(draft, target, weights="fp8")).state_dict())
    with pytest.raises(FastARError, match="holds fp8 weights .*weight_dtype auto or fp8"):
        load_drafter(out, target, weights="int8")


def test_wrong_requests_are_refused_with_what_to_do(tmp_path):
    out = write_quantised(DEMO_AR, "int8", tmp_path / "a.safetensors")
    with pytest.raises(FastARError, match="holds int8 weights .*load it with weight_dtype auto or int8; for fp8, "
                       "quantise the full-precision checkpoint"):
        load_ar_model(out, "fp8")
    with pytest.raises(FastARError, match="holds int8 weights already: quantise the full-precision checkpoint"):
        write_quantised(out, "fp8", tmp_path / "b.safetensors")
    with pytest.raises(FastARError, match="exists already: remove it, or choose another --out"):
        write_quantised(DEMO_AR, "int8", out)
    with pytest.raises(FastARError, match="is a model folder, so its 8-bit copy is a folder too"):
        write_quantised(DEMO_TEXT, "int8", tmp_path / "c.safetensors")
    with pytest.raises(FastARError, match="the 8-bit copy of a file is a .safetensors file"):
        write_quantised(DEMO_AR, "int8", tmp_path / "d.pt")
    with pytest.raises(FastARError, match="is not a model FastAR knows|not an AR model"):
        write_quantised(DEMO_VQ, "int8", tmp_path / "e.safetensors")


def test_a_file_whose_format_entry_is_unknown_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    out = write_quantised(DEMO_AR, "int8", tmp_path / "a.safetensors")
    with safe_open(str(out), "pt") as f:
        metadata = f.metadata()
    save_file(load_file(str(out)), str(tmp_path / "b.safetensors"), metadata={**metadata, STORED_FORMAT: "int4"})
    with pytest.raises(FastARError, match="metadata says 'int4', which is neither int8 nor fp8"):
        load_ar_model(tmp_path / "b.safetensors")


@pytest.mark.parametrize("path", [DEMO_AR, DEMO_TEXT], ids=["file", "folder"])
def test_an_interrupted_write_leaves_nothing_behind(path, tmp_path, monkeypatch):
    import safetensors.torch

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_quantised(path, "int8", tmp_path / ("copy" if path.is_dir() else "copy.safetensors"))
    assert list(tmp_path.iterdir()) == []


def test_the_command_writes_a_copy_that_generates_the_same_images(tmp_path, capsys):
    """``quantize`` then ``generate`` with the copy: the tokens of ``generate --weights int8`` on the source (the
    same codes, so the same images), and the command says what it wrote."""
    assert cli.main(["quantize", "--model", str(DEMO_AR), "--out", str(tmp_path / "c2i-int8.safetensors")]) == 0
    said = capsys.readouterr().out
    assert "c2i-int8.safetensors" in said and "(int8; the source: 0.01 GB)" in said
    runs = {"copy": ["--model", str(tmp_path / "c2i-int8.safetensors")], "source": ["--weights", "int8"]}
    for name, args in runs.items():
        assert cli.main(["generate", *args, "--classes", "1,4", "--seed", "3", "--quiet", "--device", "cpu",
                         "--out", str(tmp_path / f"{name}.png"), "--tokens-out", str(tmp_path / f"{name}.json")]) == 0
    tokens = {name: json.loads((tmp_path / f"{name}.json").read_text())["tokens"] for name in runs}
    assert tokens["copy"] == tokens["source"]
