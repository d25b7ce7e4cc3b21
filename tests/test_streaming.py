"""Weights streamed from host memory (model_loaders/shared/streaming.py): which layers may stream, what the CLI keeps on
the GPU for ``--gpu-weights``, and every family generating the same images with all its blocks streamed.

On a CPU the copy to the input's device changes nothing, so streamed weights are made HostOnly here: a tensor
that allows the copy (counted) and fails on any other use, as a weight left in host memory fails on a GPU when
code reads it outside its layer's streaming forward. The GPU check runs the real thing (commands/gpu_check.py)."""
import numpy as np
import pytest
import torch
from PIL import Image

from fastar.cli import main
from fastar.errors import FastARError
from fastar.model_loaders import load_ar_model
from fastar.model_loaders.shared import streaming
from fastar.model_loaders.shared.compiled import compile_steps, compiled_mode
from fastar.model_loaders.shared.demo import (DEMO_AR, DEMO_DD, DEMO_KL, DEMO_MAR, DEMO_TEXT, DEMO_VAR, DEMO_VAR_DD,
                                      DEMO_VAR_VQVAE, DEMO_VQ, DEMO_VQGAN)
from fastar.model_loaders.shared.quantized import quantize_weights
from fastar.model_loaders.shared.streaming import (StreamedLinear, make_streamable, place, resident_minimum,
                                            stream_buffer_bytes, streamable_layers, streamed_bytes, streamed_layers)
from fastar.samplers.decoders import DecoderSpec, decode
from fastar.samplers.processing import SamplingSettings
from fastar.tests.conformance.common import fixture
from tiny_janus import hf_model as janus_hf_model, write_converted
from tiny_llamagen import tiny_conditioning, tiny_model

EMU3 = fixture("emu3_hf")  # transformers' layout: its VQ model in the folder
COPIES = {"count": 0}
ALLOWED = {"numel", "element_size", "__get__", "size", "dim", "is_pinned", "data_ptr", "is_floating_point"}


class HostOnly(torch.Tensor):
    """A streamed weight in these tests: ``.to(device)`` gives a plain tensor (a copy, counted); anything else
    fails, as a weight in host memory used directly by a GPU computation would."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        with torch._C.DisableTorchFunctionSubclass():
            if name == "to":
                COPIES["count"] += 1
                return func(*args, **(kwargs or {})).as_subclass(torch.Tensor)
            if name in ALLOWED:
                return func(*args, **(kwargs or {}))
        raise AssertionError(f"a streamed weight was used outside its layer's forward ({name})")


def host_only(model) -> None:
    for layer in streamed_layers(model):
        for name, p in list(layer.named_parameters(recurse=False)):
            layer._parameters[name] = p.detach().as_subclass(HostOnly)
        for name, b in list(layer.named_buffers(recurse=False)):  # an 8-bit layer's codes and scales
            layer._buffers[name] = b.as_subclass(HostOnly)


def stream_everything(model) -> int:
    """All of ``model``'s blocks streamed, their weights HostOnly; returns the streamed bytes."""
    streamed = place(model, torch.device("cpu"), resident_minimum(model))
    host_only(model)
    return streamed


def test_only_the_blocks_linear_layers_stream():
    model = tiny_model()
    in_blocks = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name.startswith("layers.")}
    make_streamable(model)
    assert in_blocks and {name for name, m in model.named_modules() if isinstance(m, StreamedLinear)} == in_blocks
    assert type(model.output) is torch.nn.Linear  # heads and embeddings stay: small, and read outside a forward


@pytest.mark.parametrize("path", [DEMO_AR, DEMO_TEXT, DEMO_MAR, DEMO_VAR, DEMO_DD, DEMO_VAR_DD],
                         ids=lambda p: p.name)
def test_every_family_loads_with_streamable_blocks(path):
    model = load_ar_model(path, device="cpu")
    layers = streamable_layers(model)
    assert layers and not any(layer.comfy_cast_weights for layer in layers)  # nothing streams unless asked
    assert streaming.streamable_bytes(model) > 0.5 * streaming.model_bytes(model), "the blocks are most weights"


def test_place_keeps_the_budget_on_the_device_and_streams_the_rest():
    model = make_streamable(tiny_model())
    total, least = streaming.model_bytes(model), resident_minimum(model)
    assert place(model, torch.device("cpu"), total) == 0 and not streamed_layers(model)
    for resident in (least, (least + total) // 2):
        streamed = place(model, torch.device("cpu"), resident)
        on_device = total - streamed + stream_buffer_bytes(model)
        assert 0 < streamed and on_device <= resident, (resident, streamed)
        first = [layer.comfy_cast_weights for layer in streamable_layers(model)]
        assert first == sorted(first), "the first blocks stay, the last ones stream"
    assert streamed_bytes(model) == streamed
    with pytest.raises(FastARError, match=r"--gpu-weights 0.00 GB is less than .* give at least .*, or 0"):
        place(model, torch.device("cpu"), least - 1)
    assert place(model, torch.device("cpu"), 0) == place(model, torch.device("cpu"), least)  # 0: the least


def test_streaming_turns_compiled_steps_off():
    model = compile_steps(make_streamable(tiny_model()), "on")
    assert compiled_mode(model) == "default"
    place(model, torch.device("cpu"), resident_minimum(model))
    assert compiled_mode(model) is None


@pytest.mark.parametrize("weights", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("spec", [DecoderSpec("ar"), DecoderSpec("sjd", window=5), DecoderSpec("gsd", window=5)],
                         ids=lambda s: s.decoder)
def test_streamed_blocks_give_the_same_tokens_and_copy_every_forward(spec, weights):
    """Plain and 8-bit blocks alike (an 8-bit layer copies its codes and scales)."""
    sampling = SamplingSettings(cfg_scale=2.0, temperature=0.9, top_k=20, top_p=0.95)
    resident, streamed = (quantize_weights(make_streamable(tiny_model(seed=3)), weights) for _ in range(2))
    stream_everything(streamed)
    want, _ = decode(resident, tiny_conditioning(resident), sampling, spec, seed=4)
    COPIES["count"] = 0
    got, stats = decode(streamed, tiny_conditioning(streamed), sampling, spec, seed=4)
    assert torch.equal(got, want)
    tensors = sum(len(list(layer.parameters())) + len(list(layer.buffers())) for layer in streamed_layers(streamed))
    assert COPIES["count"] == tensors * (stats.target_forwards + 1)  # every forward and the prefill


@pytest.fixture(scope="module")
def janus_folder(tmp_path_factory):
    return write_converted(tmp_path_factory.mktemp("janus") / "janus", janus_hf_model(seed=0))


def family_runs(janus_folder):
    return {"llamagen": ["--model", DEMO_AR, "--vq", DEMO_VQ, "--class", "3", "--decoder", "sjd"],
            "lumina-mgpt": ["--model", DEMO_TEXT, "--vq", DEMO_VQGAN, "--prompt", "a red circle", "--decoder", "sjd"],
            "janus": ["--model", janus_folder, "--vq", janus_folder, "--prompt", "a cat", "--decoder", "sjd"],
            "emu3": ["--model", EMU3, "--vq", EMU3, "--prompt", "a cat", "--negative-prompt", "blurry", "--decoder",
                     "sjd", "--image-size", "40", "--aspect-ratio", "5:4"],
            "mar": ["--model", DEMO_MAR, "--vq", DEMO_KL, "--class", "3", "--num-iter", "4", "--diffusion-steps", "5"],
            "var": ["--model", DEMO_VAR, "--vq", DEMO_VAR_VQVAE, "--class", "3"],
            "dd": ["--model", DEMO_DD, "--vq", DEMO_VQ, "--class", "3"],
            "var-dd": ["--model", DEMO_VAR_DD, "--vq", DEMO_VAR_VQVAE, "--class", "3"]}


@pytest.mark.parametrize("family", ["llamagen", "lumina-mgpt", "janus", "emu3", "mar", "var", "dd", "var-dd"])
def test_every_family_generates_the_same_with_its_blocks_streamed(family, janus_folder, tmp_path, monkeypatch):
    """The CLI's --gpu-weights path on the CPU (its GPU-only check lifted), every block streamed; with full and with
    8-bit weights (--weights int8: a quarter of fp32's bytes cross)."""
    placed = []

    def place_everything(model, device, resident, option="--gpu-weights"):
        placed.append(stream_everything(model))
        return placed[-1]

    monkeypatch.setattr(streaming, "place", place_everything)
    monkeypatch.setattr("fastar.pipeline.check_gpu_weights", lambda gpu_weights, device: None)
    runs = {}
    for weights in ("auto", "int8"):
        for name, extra in (("resident", []), ("streamed", ["--gpu-weights", "1"])):
            out = tmp_path / weights / name
            args = [*map(str, family_runs(janus_folder)[family]), "--device", "cpu", "--seed", "2", "--quiet",
                    "--latents-out", str(out / "latents.npy"), "--out", str(out / "image.png"), "--weights", weights,
                    *extra]
            assert main(["generate", *args]) == 0
            runs[weights, name] = np.load(out / "latents.npy"), np.asarray(Image.open(out / "image.png"))
    full, eight = placed
    assert full > 0 and full * 0.25 <= eight < full * 0.27  # 1-byte codes and 4-byte scales for 4-byte weights
    for weights in ("auto", "int8"):
        for streamed, resident in zip(runs[weights, "streamed"], runs[weights, "resident"]):
            np.testing.assert_array_equal(streamed, resident)
        assert runs[weights, "streamed"][1].std() > 5  # a picture, not a flat field


def test_the_cli_refuses_gpu_weights_off_a_gpu_and_below_zero(capsys):
    assert main(["generate", "--device", "cpu", "--gpu-weights", "4", "--quiet"]) == 2
    assert "--gpu-weights keeps part of a model on a GPU" in capsys.readouterr().err
    from fastar.pipeline import check_gpu_weights

    check_gpu_weights(0, torch.device("cuda"))  # 0: only what cannot stream
    with pytest.raises(FastARError, match="0: only what cannot stream"):
        check_gpu_weights(-1, torch.device("cuda"))
