"""Checks of the node layer's ComfyUI glue inside ComfyUI's own Python (run by test_comfyui_internals.py
with .comfyui/venv/bin/python): a batch keeps the prompts' negative prompts, the memory request matches the KV
cache a decode really allocates (the drafter's too), the model patcher loads and offloads FastAR models (their
CUDA-graph caches too) and drafters, Cancel aborts a decode within one iteration and the next decode works, and the
live preview greys out what is not decoded yet.

    python tests/comfyui/in_comfy_checks.py COMFYUI_DIR REPO_ROOT
"""
import importlib.util
import sys
from pathlib import Path

comfy_dir, root = Path(sys.argv[1]), Path(sys.argv[2])
sys.path.insert(0, str(comfy_dir))
sys.argv = [sys.argv[0], "--cpu"]  # ComfyUI's own arguments, parsed as main.py does
import comfy.options  # noqa: E402

comfy.options.enable_args_parsing()
spec = importlib.util.spec_from_file_location("fastar", root / "__init__.py", submodule_search_locations=[str(root)])
package = importlib.util.module_from_spec(spec)
sys.modules["fastar"] = package
spec.loader.exec_module(package)

import numpy as np  # noqa: E402
import torch  # noqa: E402

import comfy.model_management as mm  # noqa: E402
from fastar.errors import FastARError  # noqa: E402
from fastar.model_loaders.drafters.small_ar import SmallARDrafter  # noqa: E402
from fastar.model_loaders.shared.compiled import compile_steps  # noqa: E402
from fastar.model_loaders.drafters.eagle import EagleConfig, EagleDrafter, EagleHead  # noqa: E402
from fastar.model_loaders.llamagen.model import LlamaGenConfig, LlamaGenGPT  # noqa: E402
from fastar.model_loaders.shared.protocol import CaptionConditioning, ClassConditioning  # noqa: E402
from fastar.model_loaders.shared.quantized import QuantizedLinear, quantize_weights  # noqa: E402
from fastar.model_loaders.shared.streaming import (StreamedLinear, make_streamable, model_bytes,  # noqa: E402
                                            resident_minimum, streamable_layers, streamed_layers)
from fastar.model_loaders.llamagen.vq import VQConfig, VQModel  # noqa: E402
from fastar.nodes import comfy_glue as glue  # noqa: E402
from fastar.model_loaders.drafters.loader import drafter_weights  # noqa: E402
from fastar.memory import kv_cache_bytes  # noqa: E402
from fastar.model_loaders.shared.protocol import PromptConditioning  # noqa: E402
from fastar.nodes.sampler_nodes import drafter_cache_bytes, repeat_rows, working_memory  # noqa: E402
from fastar.nodes.values import DrafterHandle  # noqa: E402
from fastar.samplers.decoders import DecoderSpec, decode  # noqa: E402
from fastar.samplers.processing import SamplingSettings  # noqa: E402


def model(model_type="c2i", dtype=torch.float32, **kw):
    cfg = LlamaGenConfig(dim=32, n_layer=2, n_head=4, n_kv_head=2, vocab_size=64, grid=(4, 6), model_type=model_type,
                         num_classes=10, caption_dim=16, cls_token_num=1 if model_type == "c2i" else 5, **kw)
    torch.manual_seed(0)
    m = LlamaGenGPT(cfg).to(dtype).eval()
    for p in m.parameters():
        p.data.normal_(0, 0.2)
    return m


def rows(m, batch):
    if m.cfg.model_type == "c2i":
        return ClassConditioning(torch.arange(batch) % 10)
    return CaptionConditioning(torch.randn(batch, 5, 16), torch.ones(batch, 5, dtype=torch.bool))


def check_memory_request():
    for model_type in ("c2i", "t2i"):
        for dtype in (torch.float32, torch.bfloat16):
            m = model(model_type, dtype)
            for batch, cfg, window in ((1, True, 1), (3, False, 8), (2, True, 64)):
                session = m.start(rows(m, batch), cfg=cfg, max_window=min(window, 24))
                assert kv_cache_bytes(m, rows(m, 1), batch, cfg, min(window, 24)) == session.cache_bytes, (model_type, batch)
                spec = DecoderSpec("ar" if window == 1 else "sjd", window=max(window, 2))
                assert working_memory(m, rows(m, 1), batch, cfg, spec) > session.cache_bytes
    print("ok memory request = KV cache size + working memory")


def check_drafter_memory_and_patcher():
    target = model("t2i")
    head = EagleHead(EagleConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                 vocab_size=64)).eval()
    for drafter in (EagleDrafter(head, target), SmallARDrafter(model("t2i"))):
        handle = DrafterHandle(glue.make_patcher(drafter_weights(drafter)), drafter, target, "drafter")
        for batch, cfg, window in ((1, True, 5), (3, False, 2)):
            session = target.start(rows(target, batch), cfg=cfg, max_window=window, hidden=True)
            drafting = drafter.start(rows(target, batch), cfg=cfg, max_window=window, target_session=session)
            allocated = drafting.cache.nbytes() if isinstance(drafter, EagleDrafter) else drafting.session.cache_bytes
            asked = drafter_cache_bytes(handle, target, rows(target, 1), batch, cfg, window)
            assert allocated <= asked <= 1.2 * allocated, (drafter.name, allocated, asked)
        patchers = [glue.make_patcher(target), handle.patcher]
        glue.load_for_inference(patchers, working_memory(target, rows(target, 1), 1, True, DecoderSpec("spec"), handle))
        assert all(any(loaded.model is p for loaded in mm.current_loaded_models) for p in patchers)
        mm.unload_all_models()
    print("ok drafter memory request covers its KV cache; target and drafter load together")


def check_patcher_load_offload():
    m = model()
    patcher = glue.make_patcher(m)
    assert patcher.model.inner is m and patcher.load_device == mm.get_torch_device()
    glue.load_for_inference([patcher], working_memory(m, rows(m, 1), 1, True, DecoderSpec("sjd")))
    assert any(loaded.model is patcher for loaded in mm.current_loaded_models), "not registered with ComfyUI"
    assert all(p.device == patcher.load_device for p in m.parameters())
    compile_steps(m, "on", mode="reduce-overhead").start(rows(m, 1), cfg=True, max_window=2)  # CUDA's caches
    assert m.static_buffers.nbytes() > 0
    mm.unload_all_models()
    assert not any(loaded.model is patcher for loaded in mm.current_loaded_models), "not offloaded"
    assert all(p.device == patcher.offload_device for p in m.parameters())
    assert m.static_buffers is None, "the CUDA-graph caches stayed behind when ComfyUI offloaded the model"
    glue.load_for_inference([patcher], 0)  # loads again after the offload
    print(f"ok patcher loads and offloads ({type(patcher).__name__}, load {patcher.load_device})")


def check_a_run_too_big_for_the_gpu_is_refused():
    """On a GPU the sampler asks ComfyUI's total memory (others can be offloaded) before loading: weights that
    cannot fit are refused with the model's name and what to do. Faked here: a GPU with 10 bytes to spare."""
    m = model()
    patcher = glue.make_patcher(m)
    saved = glue.load_device, mm.get_total_memory, torch.cuda.get_device_name
    glue.load_device = lambda: torch.device("cuda")
    mm.get_total_memory = lambda *args, **kwargs: patcher.model_size() + 10
    torch.cuda.get_device_name = lambda device=None: "Test GPU"
    try:
        glue.check_room([("tiny.safetensors", patcher)], lambda images: images * 10**6, 2, torch.float32)
        raise AssertionError("a run bigger than the GPU was not refused")
    except FastARError as error:
        message = str(error)
        assert "on the GPU (Test GPU) (tiny.safetensors" in message and "not even batch 1 fits" in message, message
        assert "load the model in bf16 or fp16" in message, message
    finally:
        glue.load_device, mm.get_total_memory, torch.cuda.get_device_name = saved
    print("ok a run too big for the GPU is refused before loading")


def check_a_partial_load_streams_blocks():
    """A model bigger than the room ComfyUI gives it: ComfyUI's own partial load (ModelPatcher.load with a low-VRAM
    budget, as load_models_gpu calls it on a short GPU) leaves blocks in system memory with their streaming flag
    set; the glue moves whatever cannot stream; the tokens are the same; ComfyUI's offload clears the flags. A GPU
    between the least (blocks streamed) and the full need runs; below the least it is refused."""
    m = make_streamable(model())
    spec, sampling = DecoderSpec("sjd", window=3), SamplingSettings(cfg_scale=2.0, temperature=0.9, top_k=20)
    want, _ = decode(m, rows(m, 2), sampling, spec, seed=0)
    patcher = glue.make_patcher(m)
    patcher.load(patcher.load_device, lowvram_model_memory=model_bytes(m) // 2)
    streamed = streamed_layers(m)
    assert streamed and len(streamed) < len(streamable_layers(m)), "ComfyUI did not stream part of the blocks"
    assert not any(getattr(layer, "comfy_cast_weights", False) for layer in m.modules()
                   if not isinstance(layer, StreamedLinear)), "a layer that cannot stream was flagged"
    glue.move_resident(m, patcher.load_device)
    got, _ = decode(m, rows(m, 2), sampling, spec, seed=0)
    assert torch.equal(got, want)
    patcher.detach()
    assert not streamed_layers(m), "ComfyUI's offload left streaming flags behind"

    saved = glue.load_device, mm.get_total_memory, torch.cuda.get_device_name
    glue.load_device = lambda: torch.device("cuda")
    torch.cuda.get_device_name = lambda device=None: "Test GPU"
    try:
        working = lambda images: images * 10**4  # noqa: E731
        mm.get_total_memory = lambda *args, **kwargs: int((model_bytes(m) + 10**4) / 0.92) - 1
        glue.check_room([("tiny.safetensors", patcher)], working, 2, torch.float32)  # runs, streamed
        mm.get_total_memory = lambda *args, **kwargs: resident_minimum(m)
        try:
            glue.check_room([("tiny.safetensors", patcher)], working, 2, torch.float32)
            raise AssertionError("a run that does not fit even streamed was not refused")
        except FastARError as error:
            assert "with the blocks' weights streamed from system memory" in str(error), str(error)
    finally:
        glue.load_device, mm.get_total_memory, torch.cuda.get_device_name = saved
    print(f"ok ComfyUI's partial load streams {len(streamed)} of {len(streamable_layers(m))} block layers, "
          "same tokens, offload clears them; the room check counts streaming")


def check_8_bit_blocks_are_sized_and_streamed_by_comfyui():
    """An int8 model: the size ComfyUI plans with (ModelPatcher.model_size, its state dict) is the 8-bit bytes, and
    its own partial load streams the 8-bit layers (codes and scales copied per call) with the same tokens."""
    full = make_streamable(model())
    m = quantize_weights(make_streamable(model()), "int8")
    patcher = glue.make_patcher(m)
    assert patcher.model_size() == model_bytes(m) < 0.5 * model_bytes(full), (patcher.model_size(), model_bytes(m))
    spec, sampling = DecoderSpec("sjd", window=3), SamplingSettings(cfg_scale=2.0, temperature=0.9, top_k=20)
    want, _ = decode(m, rows(m, 2), sampling, spec, seed=0)
    patcher.load(patcher.load_device, lowvram_model_memory=model_bytes(m) // 2)
    streamed = streamed_layers(m)
    assert streamed and all(isinstance(layer, QuantizedLinear) for layer in streamed), streamed
    glue.move_resident(m, patcher.load_device)
    got, _ = decode(m, rows(m, 2), sampling, spec, seed=0)
    assert torch.equal(got, want)
    patcher.detach()
    assert not streamed_layers(m)
    print(f"ok an int8 model is {patcher.model_size()} bytes to ComfyUI ({model_bytes(full)} in full), and its "
          f"partial load streams {len(streamed)} 8-bit layers with the same tokens")


def check_cancel_within_one_iteration():
    m = model()
    done = []
    progress = glue.DecodeProgress(None, 24, "SJD")

    def on_iteration(n, total, tokens):
        done.append(n)
        if len(done) == 2:
            mm.interrupt_current_processing(True)  # what /interrupt does, between two iterations
        progress(n, total, tokens)

    try:
        decode(m, rows(m, 2), SamplingSettings(), DecoderSpec("sjd", window=2), seed=1, on_iteration=on_iteration)
        raise AssertionError("the decode was not interrupted")
    except mm.InterruptProcessingException:
        pass
    assert len(done) == 2, f"stopped after {len(done)} iterations"
    codes, _ = decode(m, rows(m, 2), SamplingSettings(), DecoderSpec("sjd"), seed=1)
    assert codes.shape == (2, 24)
    print("ok cancel within one iteration, the next decode works")


def check_partial_preview():
    vq = VQModel(VQConfig(codebook_size=64, embed_dim=4, z_channels=32, ch=32, ch_mult=(1, 2), num_res_blocks=1,
                          with_encoder=False)).eval()
    tokens = torch.randint(0, 64, (1, 24))
    image = glue.partial_image(vq, tokens, 8, (4, 6))
    assert image.size == (12, 8)
    pixels = torch.from_numpy(np.asarray(image).copy())
    assert (pixels[4:] == 128).all() and (pixels[2:4, 4:] == 128).all()  # rows 1.3 and up not decoded yet
    assert not glue.previews_enabled()  # started without --preview-method: ComfyUI's default is none
    from comfy.cli_args import LatentPreviewMethod, args

    args.preview_method = LatentPreviewMethod.Auto
    assert glue.previews_enabled()
    print("ok live preview shows the decoded part only, and follows --preview-method")


def check_batches_keep_the_negative_prompts():
    one = repeat_rows(PromptConditioning(["a dog"], ["blurry"]), 3)
    assert one.prompts == ["a dog"] * 3 and one.negative_prompts == ["blurry"] * 3
    default = repeat_rows(PromptConditioning(["a dog"]), 2)
    assert default.prompts == ["a dog"] * 2 and default.negative_prompts is None  # the model's own negative prompt
    rows = repeat_rows(PromptConditioning(["a", "b"], ["x", "y"]), 2)
    assert rows.prompts == ["a", "b", "a", "b"] and rows.negative_prompts == ["x", "y", "x", "y"]
    shared = repeat_rows(PromptConditioning(["a", "b"], ["x"]), 2)  # one negative prompt for every row stays one
    assert shared.prompts == ["a", "b", "a", "b"] and shared.negative_prompts == ["x"]
    print("ok a batch repeats the prompts with their negative prompts")


check_batches_keep_the_negative_prompts()
check_memory_request()
check_drafter_memory_and_patcher()
check_patcher_load_offload()
check_a_run_too_big_for_the_gpu_is_refused()
check_a_partial_load_streams_blocks()
check_8_bit_blocks_are_sized_and_streamed_by_comfyui()
check_cancel_within_one_iteration()
check_partial_preview()
print("all in-ComfyUI checks passed")
