"""Glue shared by the CLI, the benchmark and the nodes: devices, dtypes, conditioning, images.
No algorithms live here."""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from .errors import FastARError, FastARWarning
from .memory import (GB, Need, check_room, decode_bytes_per_image, free_bytes, gb, images_per_chunk,
                     token_working_bytes)
from .model_loaders.shared.protocol import ClassConditioning, PromptConditioning
from .samplers.processing import DTYPE_NAMES

DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise FastARError(f"unknown device '{name}': use auto, cpu, cuda or cuda:N") from e
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise FastARError(f"device '{name}' asked for, but this PyTorch sees no CUDA GPU: use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            count = torch.cuda.device_count()
            raise FastARError(f"device '{name}' asked for, but this machine has {count} CUDA GPU"
                              f"{'s' if count > 1 else ''} (cuda:0..cuda:{count - 1})")
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise FastARError(f"device '{name}' asked for, but this PyTorch sees no Apple GPU (MPS): use --device cpu")
    elif device.type != "cpu":
        raise FastARError(f"device '{name}': FastAR runs on cpu, cuda or cuda:N and mps")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: fp32 on CPU; on a GPU bf16 where its hardware has it (Ampere and newer), else fp16, as ComfyUI
    chooses (PyTorch's is_bf16_supported() also counts bf16 emulated in software: slow on older cards)."""
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if native_bf16(device) else torch.float16
    if name not in DTYPES:
        raise FastARError(f"unknown dtype '{name}': use auto, {', '.join(DTYPES)}")
    return DTYPES[name]


# the CPU instructions that compute each half precision's matrix products, and torch's checks for them
CPU_HALF_SUPPORT = {torch.bfloat16: ("AVX-512 BF16 or AMX", ("_is_avx512_bf16_supported", "_is_amx_tile_supported")),
                    torch.float16: ("AMX-FP16", ("_is_amx_fp16_supported",))}


def warn_if_emulated(dtype: torch.dtype, device: torch.device) -> None:
    """bf16 or fp16 asked for on a CPU without instructions for it: PyTorch emulates it, slower than fp32 (a
    32-row product measured about 4x slower on an AVX2 CPU). On a CPU that has them it can be the faster choice
    (README: the LlamaGen-L shape's steps), so nothing is said there."""
    if device.type != "cpu" or dtype not in CPU_HALF_SUPPORT or cpu_computes(dtype):
        return
    name, (instructions, _) = DTYPE_NAMES[dtype], CPU_HALF_SUPPORT[dtype]
    warnings.warn(f"--dtype {name} on this CPU is emulated (it has no {instructions}): slower than fp32, several "
                  f"times over a window or batch of tokens; leave --dtype out for fp32 unless halving the memory is "
                  "the point", FastARWarning, stacklevel=3)


def cpu_computes(dtype: torch.dtype) -> bool:
    """Whether this CPU has instructions for ``dtype``'s products (torch's checks are private: one missing from
    this torch counts as no)."""
    return any(getattr(torch.cpu, check, lambda: False)() for check in CPU_HALF_SUPPORT[dtype][1])


def native_bf16(device: torch.device) -> bool:
    if torch.version.hip:  # ROCm: PyTorch's own answer, emulation left out
        with torch.cuda.device(device):
            return torch.cuda.is_bf16_supported(including_emulation=False)
    return torch.cuda.get_device_capability(device)[0] >= 8


def check_class_index(label: int, num_classes: int) -> None:
    if not 0 <= label < num_classes:
        raise FastARError(f"class {label} is out of range: this model has classes 0..{num_classes - 1}")


def class_conditioning(model, classes: list[int]) -> ClassConditioning:
    """Labels for a class-conditional model, checked against its class count."""
    for c in classes:
        check_class_index(c, model.cfg.num_classes)
    return ClassConditioning(torch.tensor(classes, dtype=torch.long, device=model.device))


CONDITIONING_TYPES = {"class": "c2i", "caption": "t2i", "prompt": "prompt"}
CONDITIONING_NAMES = {"c2i": "class-to-image", "t2i": "text-to-image (FLAN-T5 features)",
                      "prompt": "text-to-image (own tokenizer)"}


def conditioning_type(model) -> str:
    """What a model is conditioned on: "c2i" (class labels), "t2i" (T5 caption features, LlamaGen t2i) or
    "prompt" (prompt text it tokenises itself: Lumina-mGPT, Anole, Janus)."""
    return CONDITIONING_TYPES[getattr(model, "conditioning_kind", "class")]


def parse_class(value: str, class_names: list[str]) -> int:
    """A class given as an index or as one of the model's class names."""
    if value.strip().lstrip("-").isdigit():
        return int(value)
    names = [n.lower() for n in class_names]
    if value.strip().lower() in names:
        return names.index(value.strip().lower())
    known = ", ".join(class_names) if class_names else "none (use an index)"
    raise FastARError(f"unknown class '{value}': give an index or a class name ({known})")


@torch.no_grad()
def decode_images(decoder, inputs: torch.Tensor, chunk: int | None = None) -> np.ndarray:
    """The image decoder's inputs (VQ codes ``[B, h, w]`` or KL latents ``[B, C, h, w]``) -> uint8 RGB
    ``[B, H, W, 3]``, ``chunk`` images at a time (default: as many as there is room for, memory.py)."""
    chunk = chunk or images_per_chunk(decoder, inputs)
    return np.concatenate([decode_part(decoder, part) for part in inputs.split(chunk)])


def decode_part(decoder, part: torch.Tensor) -> np.ndarray:
    """One chunk of images; out of memory, it is halved and tried again, down to one image."""
    try:
        pixels = decoder.decode(part.to(decoder.device)).float().clamp(-1, 1)
    except torch.OutOfMemoryError as error:
        if len(part) > 1:
            torch.cuda.empty_cache()
            return np.concatenate([decode_part(decoder, half) for half in part.split((len(part) + 1) // 2)])
        need = decode_bytes_per_image(decoder, tuple(part.shape[-2:]))
        raise FastARError(f"decoding one image ran out of memory on {decoder.device} (it needs about {gb(need)}): "
                          "close what else uses the GPU, or decode on the CPU") from error
    return ((pixels + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


def check_token_room(ar, conditioning, sampling, spec, drafted: bool = False) -> None:
    """On a GPU, refuse a token decode whose caches and activations cannot fit what the loaded weights left free
    (before it starts, not with an out-of-memory error halfway), saying which batch would."""
    free = free_bytes(ar.device)
    if free is None:
        return
    rows_per_image = conditioning.batch

    def working(batch: int) -> int:
        return token_working_bytes(ar, conditioning, batch, sampling.use_cfg, spec, drafted=drafted)

    check_room(Need({}, working, rows_per_image), free, f"{ar.device} beside the loaded weights", dtype=ar.dtype)


def outputs_to_images(decoder, model, outputs: torch.Tensor) -> np.ndarray:
    """A model's outputs (codes ``[B, h*w]``, or MAR tokens ``[B, L, C]``) -> uint8 RGB ``[B, H, W, 3]``."""
    return decode_images(decoder, model.decoder_input(outputs))


def check_image_decoder(model, decoder) -> None:
    """The image decoder must read what the model writes: VQ codes of the same codebook, or KL latents with
    the same channels. A model whose pairing rule is its family's own (Infinity's BSQ VAE) checks it itself."""
    if hasattr(model, "check_image_decoder"):
        model.check_image_decoder(decoder)
        return
    if getattr(model, "kind", "token-ar") == "masked-ar":
        if decoder.input_kind != "latents":
            raise FastARError(f"a MAR model writes continuous latents: its image decoder is a KL autoencoder (the "
                              f"official kl16.ckpt for MAR), not {decoder.what}")
        if decoder.cfg.embed_dim != model.cfg.token_dim:
            raise FastARError(f"the KL autoencoder has {decoder.cfg.embed_dim} latent channels but the MAR model writes "
                              f"{model.cfg.token_dim}: pick the autoencoder the model was trained with")
        return
    if getattr(model, "decoder_kind", "codes") == "multi-scale":  # VAR and VAR-DD
        if decoder.input_kind != "multi-scale":
            raise FastARError(f"{model.what} writes the token maps of its scales: its image decoder is its multi-scale "
                              f"VQVAE (vae_ch160v4096z32.pth for the release), not {decoder.what}")
        if (decoder.cfg.codebook_size, decoder.cfg.z_channels) != (model.vocab_size, model.cfg.channels):
            raise FastARError(f"the VQVAE has {decoder.cfg.codebook_size} codes of width {decoder.cfg.z_channels} but "
                              f"the model predicts {model.vocab_size} of width {model.cfg.channels}: pick the VQVAE "
                              "it was trained with (its teacher's, for a student)")
        if decoder.cfg.patch_nums != model.cfg.patch_nums:
            raise FastARError(f"the VQVAE works over the scales {list(decoder.cfg.patch_nums)} but the model over "
                              f"{list(model.cfg.patch_nums)}. A VQVAE's weights do not show its scales: it takes "
                              "them from NAME.json beside its file (vae_x.json for vae_x.pth), else the release's "
                              "256 px ones. If it is the model's VQVAE, write {\"patch_nums\": "
                              f"{list(model.cfg.patch_nums)}}} into its NAME.json; if not, pick the VQVAE the model "
                              "was trained with")
        return
    if decoder.input_kind != "codes":
        raise FastARError(f"{model.what} writes VQ codes: its image decoder is its VQ tokenizer, not {decoder.what}")
    if decoder.cfg.codebook_size != model.vocab_size:
        raise FastARError(f"the VQ decoder has {decoder.cfg.codebook_size} codes but the AR model predicts "
                          f"{model.vocab_size}: pick the VQ the model was trained with")
    if getattr(model, "kind", "token-ar") == "few-step" and decoder.cfg.embed_dim != model.cfg.channels:
        raise FastARError(f"the VQ decoder's codes are {decoder.cfg.embed_dim}-wide but the student writes "
                          f"{model.cfg.channels}-wide vectors: pick the VQ of the student's teacher")


@dataclass
class LoadedModels:
    ar: torch.nn.Module
    vq: torch.nn.Module | None  # the image decoder: VQ tokenizer or KL autoencoder
    drafter: object | None = None

    def codebook(self) -> torch.Tensor | None:
        """The code vectors as the VQ decoder uses them (LANTERN's latent space); None for KL latents."""
        return None if self.vq is None else self.vq.codebook()


def load_models(model_path: str | None, vq_path: str | None, device: str = "auto", dtype: str = "auto",
                drafter_path: str | None = None, image_size: int | None = None, compile_switch: str = "off",
                gpu_weights: float | None = None, weights: str = "auto", aspect_ratio: str | None = None) -> LoadedModels:
    """The AR model, image decoder and optional drafter; the model defaults to the bundled demo model, the image
    decoder of a bundled model to its bundled one, ``drafter_path="demo"`` is the bundled demo drafter. ``image_size`` (pixels) overrides the model's.
    ``compile_switch`` (on, auto, off): the token model's decoding steps through torch.compile
    (model_loaders/shared/compiled.py). ``gpu_weights``: GB of the model's weights kept on the GPU, the rest streamed
    from host memory at every step (model_loaders/shared/streaming.py); None: all of them. ``weights``: the
    model's and the drafter's blocks in 8 bits (int8, fp8; model_loaders/shared/quantized.py) or as the checkpoint
    has them (auto). ``aspect_ratio`` ("W:H"): for the families that draw other shapes than squares (Emu3,
    Lumina-mGPT)."""
    from .model_loaders import load_ar_model, load_image_decoder
    from .model_loaders.shared.compiled import compile_steps
    from .model_loaders.shared.demo import DEMO_AR, demo_image_decoder
    from .model_loaders.drafters.loader import load_drafter
    from .model_loaders.shared.streaming import place

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    warn_if_emulated(dt, dev)
    check_gpu_weights(gpu_weights, dev)
    try:
        shape = {"aspect_ratio": aspect_ratio} if aspect_ratio is not None else {}
        ar = load_ar_model(model_path or DEMO_AR, weights, device=dev if gpu_weights is None else "cpu", dtype=dt,
                           image_size=image_size, **shape)
        streamed = 0 if gpu_weights is None else place(ar, dev, int(gpu_weights * GB))
    except torch.OutOfMemoryError as error:
        free, total = torch.cuda.mem_get_info(dev)
        smaller = "load it in bf16 or fp16 (--dtype), or " if dt == torch.float32 else ""
        raise FastARError(f"{model_path} does not fit in {dev}'s free memory ({gb(free)} of {gb(total)}): {smaller}"
                          f"keep part of its weights in system memory (--gpu-weights {max(free - GB, 0) / GB:.0f}, "
                          "slower), close other programs that use the GPU, or run on the CPU (--device cpu)") from error
    if streamed:
        warnings.warn(f"{gb(streamed)} of the model's weights stay in system memory and stream to {dev} at every step "
                      "(slower; compiled steps off)", FastARWarning, stacklevel=2)
    if weights == "fp8" and dev.type == "cpu":
        warnings.warn("fp8 weights are slow on the CPU (it has no fp8 matmul: every step widens every weight, about "
                      "13x a bf16 step): --weights int8 saves the same memory and, with --dtype bf16, runs faster "
                      "than unquantised weights", FastARWarning, stacklevel=2)
    compile_steps(ar, compile_switch)
    vq_path = vq_path or demo_image_decoder(model_path or DEMO_AR)
    vq = load_image_decoder(vq_path, device=dev, dtype=torch.float32 if dev.type == "cpu" else dt) if vq_path else None
    if vq is not None:
        check_image_decoder(ar, vq)
    drafter = load_drafter(drafter_path, ar, device=dev, dtype=dt, weights=weights) if drafter_path else None
    return LoadedModels(ar, vq, drafter)


def check_gpu_weights(gpu_weights: float | None, device: torch.device) -> None:
    if gpu_weights is None:
        return
    if device.type != "cuda":
        raise FastARError(f"--gpu-weights keeps part of a model on a GPU; this run is on {device}, where all of it "
                          "is already in one memory: leave --gpu-weights out")
    if gpu_weights < 0:
        raise FastARError(f"--gpu-weights {gpu_weights}: give the GB of weights to keep on the GPU (0: only what "
                          "cannot stream)")


def conditioning_for(model, *, classes: list[str] | None = None, batch: int = 1,
                     prompts: list[str] | None = None, t5_folder: str | None = None,
                     negative_prompts: list[str] | None = None):
    """Conditioning rows for a class-conditional (``classes``) or text-conditional (``prompts``) model;
    ``negative_prompts`` for the models that take them (Emu3)."""
    if batch < 1:
        raise FastARError(f"batch {batch} must be at least 1")
    kind = getattr(model, "conditioning_kind", "class")
    if kind == "prompt":  # the model tokenises prompts itself (Lumina-mGPT, Anole)
        if not prompts:
            raise FastARError(f"this is {model.what}, a text-to-image model: give --prompt (one per row, or one "
                              "for the whole batch)")
        if classes:
            raise FastARError(f"this is {model.what}, a text-to-image model: give --prompt, not --class")
        if negative_prompts and not getattr(model, "takes_negative_prompt", False):
            raise FastARError(f"this is {model.what}, whose release guides CFG without a negative prompt: leave "
                              "--negative-prompt out")
        return PromptConditioning(prompts * batch if len(prompts) == 1 else prompts, negative_prompts or None)
    if negative_prompts:
        raise FastARError(f"--negative-prompt is for Emu3 models; this is {model.what}: leave it out")
    if kind == "caption":
        if not prompts or not t5_folder:
            raise FastARError("this is a text-to-image model: give --prompt and --t5 (a local FLAN-T5 folder)")
        from .model_loaders.llamagen.t5 import captions_for, load_t5_encoder

        prompts = prompts * batch if len(prompts) == 1 else prompts
        encoder = load_t5_encoder(t5_folder, device=model.device)
        return captions_for(model, encoder, prompts)
    if prompts:
        raise FastARError("this is a class-conditional model: give --class or --classes, not --prompt")
    names = model.cfg.class_names
    if not classes:
        warnings.warn(first_class_note(model), FastARWarning, stacklevel=2)
    labels = [parse_class(c, names) for c in (classes or ["0"])]
    if len(labels) == 1:
        labels = labels * batch
    return class_conditioning(model, labels)


def first_class_note(model) -> str:
    """What a class-conditional model draws when no class is given (its first), and how to choose one."""
    names = model.cfg.class_names
    which = f"class 0 ({names[0]})" if names else "class 0"
    choices = f"an index 0..{model.cfg.num_classes - 1}" + (f" or a name: {', '.join(names)}" if names else "")
    return f"no --class given: drawing {which}; choose with --class ({choices}), or --classes A,B,... one per image"
