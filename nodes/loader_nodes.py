"""Loaders and conditioning nodes: Load AR Model, Load VQ Decoder, Load Drafter, Class Label, Text Conditioning."""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import torch
from comfy_api.latest import io

from ..errors import FastARError
from ..model_loaders.shared.compiled import SWITCH, compile_steps, switch_error
from ..model_loaders.shared.demo import DEMO_DRAFTER, DEMO_TEXT_DRAFTER, demo_drafter
from ..model_loaders.shared.protocol import ClassConditioning, PromptConditioning
from ..model_loaders.shared.quantized import WEIGHT_FORMATS
from ..pipeline import DTYPES, check_class_index, conditioning_type
from . import comfy_glue as glue
from . import files
from .values import (CONDITIONING_TYPE, DRAFTER_TYPE, MODEL_TYPE, VQ_TYPE, Conditioning, DrafterHandle,
                     ModelHandle)

FastARModel = io.Custom(MODEL_TYPE)
FastARVQ = io.Custom(VQ_TYPE)
FastARDrafter = io.Custom(DRAFTER_TYPE)
FastARConditioning = io.Custom(CONDITIONING_TYPE)

NOTHING_FOUND = "(none found: see the tooltip)"
NO_T5 = "(none: the model reads the prompt itself)"
DTYPE_TOOLTIP = ("Weights precision. auto: ComfyUI's choice for your device (bf16 or fp16 on GPUs, fp32 on CPU). "
                 "fp16/bf16 halve memory; fp32 is the reference.")


WEIGHTS_TOOLTIP = ("The transformer blocks' weights in 8 bits, quantised as the model loads (nothing to download): "
                   "int8 or fp8 (e4m3, as ComfyUI's fp8 weight dtypes), each with a scale per output channel: the "
                   "blocks take half the memory of bf16, at a small cost in fidelity; embeddings, norms and the "
                   "output head keep the dtype above. auto: the weights as the checkpoint has them (an 8-bit copy "
                   "written by python -m fastar quantize loads in its own format, with nothing to quantise). On a "
                   "CPU pick int8 (with dtype bf16 it is faster than unquantised weights): fp8 is slow there.")


def weights_error(weights: str) -> str | None:
    if weights not in WEIGHT_FORMATS:
        return f"unknown weight_dtype '{weights}': choose one of {', '.join(WEIGHT_FORMATS)}"
    return None


def listed(names: list[str]) -> list[str]:
    return names or [NOTHING_FOUND]


def load_error(name: str, kind: str) -> str | None:
    """Why ``name`` cannot be loaded as ``kind``, when a look at the file tells (before the run)."""
    if name == NOTHING_FOUND:
        return f"no {files.KIND_NAMES[kind]} found: {files.where(kind)}"
    try:
        path = files.resolve(name, kind)
    except FastARError as e:
        return str(e)
    return files.checkpoint_kind_error(path, kind)


def dtype_error(dtype: str) -> str | None:
    if dtype not in glue.DTYPE_CHOICES:
        return f"unknown dtype '{dtype}': choose one of {', '.join(glue.DTYPE_CHOICES)}"
    return None


def raise_if(message: str | None) -> None:
    if message:
        raise FastARError(message)


IMAGE_SIZES = ("auto", "128", "256", "384", "512", "768", "1024")  # pixels; 128 is the demo model's
# width:height, for the models whose release draws other shapes than squares (Emu3, Lumina-mGPT, Infinity); 1:1 is
# every model's; 5:3 and 2:1 are shapes of Lumina-mGPT's 512 px release; 7:4, 5:2 and 3:1 Infinity's templates
ASPECT_RATIOS = ("1:1", "4:3", "3:4", "5:4", "4:5", "3:2", "2:3", "16:9", "9:16", "21:9", "9:21", "5:3", "3:5", "2:1",
                 "1:2", "7:4", "4:7", "5:2", "2:5", "3:1", "1:3")


def image_size_error(image_size: str) -> str | None:
    if image_size not in IMAGE_SIZES:
        return f"unknown image size '{image_size}': choose one of {', '.join(IMAGE_SIZES)}"
    return None


def aspect_ratio_error(aspect_ratio: str) -> str | None:
    if aspect_ratio not in ASPECT_RATIOS:
        return f"unknown aspect ratio '{aspect_ratio}': choose one of {', '.join(ASPECT_RATIOS)}"
    return None


class CheckpointLoader(io.ComfyNode):
    """What every loader of a listed checkpoint does: check the pick before the run, reload when the file
    changes on disk, resolve and check it and the other widgets when it runs. A subclass's ``validate_inputs``
    names its checkpoint input alone and returns ``checked``: ComfyUI reports what it returns on every input it
    names, and skips its own checks of those (the list check among them, which ``checked`` replaces), so the
    other widgets keep ComfyUI's checks (ComfyUI 0.3.75 checks no V3 list: ``loaded`` checks the dtype). It
    calls ``loaded`` when it runs and loads the resolved path in ``load``."""

    KIND = files.AR

    @classmethod
    def checked(cls, name: str):
        return load_error(name, cls.KIND) or True

    @classmethod
    def fingerprint(cls, name: str, *settings):
        try:
            return files.fingerprint(cls.path(name)), *settings
        except FastARError:
            return name, *settings

    @classmethod
    def path(cls, name: str) -> Path:
        return files.resolve(name, cls.KIND)

    @classmethod
    def loaded(cls, name: str, dtype: str, **settings) -> io.NodeOutput:
        raise_if(dtype_error(dtype) or load_error(name, cls.KIND))
        return io.NodeOutput(cls.load(cls.path(name), name, dtype, **settings))

    @classmethod
    def load(cls, path: Path, name: str, dtype: str, **settings):
        raise NotImplementedError


class LoadARModel(CheckpointLoader):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="FastARLoadModel",
            display_name="FastAR Load AR Model",
            category="FastAR/loaders",
            description="Loads an autoregressive image model from ComfyUI's models/fastar folder: LlamaGen "
                        "class-to-image or text-to-image (a .safetensors/.pt file or a Hugging Face style folder), "
                        "Lumina-mGPT, Anole, Janus-Pro and Emu3 (their release folders), "
                        "MAR (the official mar_base/large/huge .pth files), a Distilled Decoding student "
                        "(llamagen-B.pt / llamagen-L.pt, or one made with distill-dd), VAR or Infinity (their "
                        "release .pth files; Infinity-8B's infinity_8b_weights/ folder). The bundled demo model "
                        "(demo_c2i.safetensors) is always listed.",
            inputs=[
                io.Combo.Input("model_name", options=listed(files.choices(files.AR)),
                               tooltip="Checkpoint file or HF-style folder (name ending in /) in models/fastar or a "
                                       "fastar: path of extra_model_paths.yaml. demo_c2i.safetensors is the bundled "
                                       "demo model (8 shape classes, 128 px, runs on CPU in seconds)."),
                io.Combo.Input("dtype", options=list(glue.DTYPE_CHOICES), default="auto", tooltip=DTYPE_TOOLTIP),
                # optional: prompts saved before it existed stay valid
                io.Combo.Input("image_size", options=list(IMAGE_SIZES), default="auto", optional=True,
                               tooltip="Image size in pixels. auto: what the checkpoint says (training args, config, "
                                       "or the size in an official file name such as c2i_L_384.pt = 384 px; 256 px "
                                       "with a warning in the console when nothing says; Emu3: 720, an area of "
                                       "720 x 720 pixels; Infinity: 1024, its release's 1M-pixel schedule, and "
                                       "256, 512 or 768 pick its smaller ones). Pick a size for a file that does "
                                       "not say it, or to run a model at another size."),
                io.Combo.Input("compile", options=list(SWITCH), default="auto", optional=True,
                               tooltip="Decoding steps through torch.compile: the same images, faster steps "
                                       "(1.5-1.7x per image for the demo model on a CPU; 3.9-7.6x per step for "
                                       "7B and LlamaGen-XL shapes on an H200, as CUDA graphs). The first image of "
                                       "each batch size and window compiles once per ComfyUI session (3-20 s on a "
                                       "CPU, under a minute per window width for a 7B model on an H200). auto: on where FastAR has "
                                       "proven it gives the same tokens (CPU, NVIDIA GPUs), off elsewhere, and "
                                       "off while part of the model streams from system memory (a GPU too "
                                       "small for it). A drafter follows its model: compiled when it is. MAR: "
                                       "on compiles its transformer call and diffusion head's reverse steps "
                                       "(for GPUs; auto leaves them eager for now), VAR each scale's forward "
                                       "(likewise); DD students ignore it."),
                io.Combo.Input("weight_dtype", options=list(WEIGHT_FORMATS), default="auto", optional=True,
                               tooltip=WEIGHTS_TOOLTIP),
                io.Combo.Input("aspect_ratio", options=list(ASPECT_RATIOS), default="1:1", optional=True,
                               tooltip="The image's width:height, for models whose release draws other shapes than "
                                       "squares (Emu3: the image keeps the area of image_size squared, 8 px per "
                                       "token: 16:9 at 720 is 68 x 120 tokens, 1:1 90 x 90; Lumina-mGPT: its "
                                       "release's shape of that ratio, 16:9 at 768 is 1024 x 576 px, and a ratio "
                                       "it does not draw is refused with the ones it does; Infinity: the scale "
                                       "schedule of its nearest template, 1:1 to 3:1 and 1:3). Other models draw "
                                       "squares and refuse any other ratio than 1:1. The model is built for its "
                                       "grid: another ratio reloads it."),
            ],
            outputs=[FastARModel.Output("model", display_name="model",
                                        tooltip="The AR model, managed by ComfyUI (loaded to the GPU "
                                                "when sampling, offloaded when others need room).")],
        )

    @classmethod
    def validate_inputs(cls, model_name):
        return cls.checked(model_name)

    @classmethod
    def fingerprint_inputs(cls, model_name, dtype, image_size="auto", compile="auto", weight_dtype="auto",
                           aspect_ratio="1:1"):
        return cls.fingerprint(model_name, dtype, image_size, compile, weight_dtype, aspect_ratio)

    @classmethod
    def execute(cls, model_name, dtype, image_size="auto", compile="auto", weight_dtype="auto",
                aspect_ratio="1:1") -> io.NodeOutput:
        raise_if(image_size_error(image_size) or switch_error(compile) or weights_error(weight_dtype)
                 or aspect_ratio_error(aspect_ratio))
        return cls.loaded(model_name, dtype, image_size=None if image_size == "auto" else int(image_size),
                          compile_switch=compile, weights=weight_dtype,
                          aspect_ratio=None if aspect_ratio == "1:1" else aspect_ratio)

    @classmethod
    def load(cls, path, name, dtype, image_size=None, compile_switch="auto", weights="auto", aspect_ratio=None):
        from ..model_loaders import load_ar_model

        shape = {"aspect_ratio": aspect_ratio} if aspect_ratio is not None else {}
        model = load_ar_model(path, weights, device=glue.offload_device(),
                              dtype=glue.choose_dtype(dtype, glue.load_device()), image_size=image_size, **shape)
        return ModelHandle(glue.make_patcher(compile_steps(model, compile_switch)), name)


class LoadVQ(CheckpointLoader):
    KIND = files.VQ

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="FastARLoadVQ",
            display_name="FastAR Load Image Decoder (VQ / KL)",
            category="FastAR/loaders",
            description="Loads the image decoder that turns a model's output into pixels: a VQ tokenizer for "
                        "token models (LlamaGen VQ-16 family) or a KL autoencoder for MAR (LDM AutoencoderKL). Use "
                        "the one the model was trained with: demo_vq.safetensors for the demo model, "
                        "demo_kl_vae.safetensors for the demo MAR, vq_ds16_c2i.pt / vq_ds16_t2i.pt for LlamaGen, "
                        "kl16.ckpt for MAR, vqgan.ckpt for Lumina-mGPT and Anole, the model folder itself for "
                        "Janus-Pro and transformers' Emu3-Gen-hf, the Emu3-VisionTokenizer folder for BAAI's "
                        "Emu3-Gen.",
            inputs=[
                io.Combo.Input("vq_name", options=listed(files.choices(files.VQ)),
                               tooltip="Image decoder checkpoint or folder (name ending in /) in models/fastar "
                                       "(or a fastar: path of extra_model_paths.yaml): model folders that hold "
                                       "their decoder (Janus-Pro, Emu3-Gen-hf) and Emu3 VisionTokenizer folders are "
                                       "listed too. demo_vq.safetensors and demo_kl_vae.safetensors are the "
                                       "bundled demo decoders."),
                io.Combo.Input("dtype", options=list(glue.DTYPE_CHOICES), default="auto", tooltip=DTYPE_TOOLTIP),
            ],
            outputs=[FastARVQ.Output("vq", display_name="vq",
                                     tooltip="The image decoder, managed by ComfyUI.")],
        )

    @classmethod
    def validate_inputs(cls, vq_name):
        return cls.checked(vq_name)

    @classmethod
    def fingerprint_inputs(cls, vq_name, dtype):
        return cls.fingerprint(vq_name, dtype)

    @classmethod
    def execute(cls, vq_name, dtype) -> io.NodeOutput:
        return cls.loaded(vq_name, dtype)

    @classmethod
    def load(cls, path, name, dtype):
        from ..model_loaders import load_image_decoder

        vq = load_image_decoder(path, device=glue.offload_device(),
                           dtype=glue.choose_dtype(dtype, glue.load_device(), for_vq=True))
        return ModelHandle(glue.make_patcher(vq), name)


DEMO_DRAFTER_NAME = f"{DEMO_DRAFTER.name}/"


class LoadDrafter(CheckpointLoader):
    KIND = files.DRAFTER

    @classmethod
    def define_schema(cls):
        options = listed(files.choices(files.DRAFTER))
        return io.Schema(
            node_id="FastARLoadDrafter",
            display_name="FastAR Load Drafter",
            category="FastAR/loaders",
            description="Loads a drafter for speculative decoding, bound to the AR model it drafts for: a "
                        "LANTERN/EAGLE drafter folder (config.json + weights: LANTERN's llamagen_drafter for LlamaGen, "
                        "anole_drafter for Anole, one trained by python -m fastar train-drafter for Lumina-mGPT) or a "
                        "smaller LlamaGen model trained on the same VQ codes; for a MAR model, a smaller MAR on the "
                        "same autoencoder (MAR-B for MAR-L/H). A "
                        "drafter made for another model (other codebook, width or kind) is refused with the reason.",
            inputs=[
                FastARModel.Input("model", tooltip="The AR model the drafter drafts for (an EAGLE drafter reads its "
                                                   "hidden states and uses its output head)."),
                io.Combo.Input("drafter_name", options=options,
                               default=DEMO_DRAFTER_NAME if DEMO_DRAFTER_NAME in options else options[0],
                               tooltip="Drafter folder (name ending in /) or file in models/fastar_drafters (or a "
                                       "fastar_drafters: path of extra_model_paths.yaml); EAGLE drafter folders in "
                                       f"models/fastar are listed too. {DEMO_DRAFTER_NAME} is the bundled drafter "
                                       f"of the demo model, {DEMO_TEXT_DRAFTER.name}/ the text demo's."),
                io.Combo.Input("dtype", options=list(glue.DTYPE_CHOICES), default="auto",
                               tooltip="Drafter weights precision. auto: the AR model's precision. fp16/bf16 halve "
                                       "memory; fp32 is the reference."),
                io.Combo.Input("weight_dtype", options=list(WEIGHT_FORMATS), default="auto", optional=True,
                               tooltip=WEIGHTS_TOOLTIP),
            ],
            outputs=[FastARDrafter.Output("drafter", display_name="drafter",
                                          tooltip="The drafter, bound to this AR model and managed by ComfyUI: "
                                                  "connect it to a sampler that uses the same model.")],
        )

    @classmethod
    def validate_inputs(cls, drafter_name):
        return cls.checked(drafter_name)

    @classmethod
    def fingerprint_inputs(cls, drafter_name, dtype, model=None, weight_dtype="auto"):  # widget values, not links
        return cls.fingerprint(drafter_name, dtype, weight_dtype)

    @classmethod
    def execute(cls, model, drafter_name, dtype, weight_dtype="auto") -> io.NodeOutput:
        raise_if(weights_error(weight_dtype))
        return cls.loaded(drafter_name, dtype, model=model, weights=weight_dtype)

    @classmethod
    def load(cls, path, name, dtype, model: ModelHandle, weights="auto"):
        from ..model_loaders.drafters.loader import drafter_weights, load_drafter

        target = model.module
        drafter = load_drafter(path, target, device=glue.offload_device(),
                               dtype=None if dtype == "auto" else DTYPES[dtype], weights=weights)
        return DrafterHandle(glue.make_patcher(drafter_weights(drafter)), drafter, target, name)


def bundled_drafter(model: ModelHandle) -> DrafterHandle | None:
    """The bundled drafter of a bundled model, loaded as Load Drafter loads it: what a sampler whose decoder drafts
    by default (LANTERN) takes when no drafter is connected. None for any other model."""
    try:
        drafter = demo_drafter(files.resolve(model.name, files.AR))
    except FastARError:
        return None
    if drafter is None:
        return None
    return LoadDrafter.load(drafter, drafter.name + ("/" if drafter.is_dir() else ""), "auto", model=model)


# -- class labels -----------------------------------------------------------------------------------

USE_INDEX = "(use index)"
REFUSED = "\u2715 "  # marks a class_name that check_class_labels found wrong for the linked model
IMAGENET_CLASSES = 1000
MAX_INDEX = 100_000
OPTION = re.compile(r"^(?P<name>.*) \((?P<demo>demo )?(?P<index>\d+)\)$")


def imagenet_names() -> list[str]:
    return (Path(__file__).with_name("imagenet_classes.txt")).read_text(encoding="utf-8").splitlines()


def class_options() -> list[str]:
    demo = [f"{name} (demo {i})" for i, name in enumerate(files.demo_class_names())]
    return [USE_INDEX, *demo, *(f"{name} ({i})" for i, name in enumerate(imagenet_names()))]


def widget_error(class_name: str, index: int) -> str | None:
    """What is wrong with the Class Label's widgets on their own."""
    if class_name not in class_options():
        return f"unknown class '{class_name}': pick one from the list, or '{USE_INDEX}' and an index"
    if class_name == USE_INDEX and index < 0:
        return f"class_name is '{USE_INDEX}' but index is {index}: give an index of 0 or more, or pick a class"
    if class_name != USE_INDEX and index >= 0:
        return (f"both a class ('{class_name}') and an index ({index}) are given: set index to -1 to use the "
                f"class, or pick '{USE_INDEX}'")
    if index > MAX_INDEX:
        return f"index {index} is out of range: use 0..{MAX_INDEX}"
    return None


def resolve_class(model, class_name: str, index: int) -> tuple[int, str]:
    """The label for ``model`` and how to name it; FastARErrors say what to pick instead."""
    if conditioning_type(model) != "c2i":
        raise FastARError("this is a text-to-image model: use FastAR Text Conditioning, not FastAR Class Label")
    cfg = model.cfg
    names = list(cfg.class_names or [])
    if class_name == USE_INDEX:
        label = index
    else:
        m = OPTION.match(class_name)
        if m is None:
            raise FastARError(f"unknown class '{class_name}': pick one from the list, or '{USE_INDEX}'")
        label, name = int(m["index"]), m["name"]
        if m["demo"]:
            if name.lower() in (n.lower() for n in names):
                label = [n.lower() for n in names].index(name.lower())
            else:
                raise FastARError(f"'{name}' is a class of the demo model, but this model "
                                  f"({cfg.num_classes} classes{': ' + ', '.join(names) if names else ''}) has no "
                                  f"such class: pick one of its classes or '{USE_INDEX}'")
        elif cfg.num_classes != IMAGENET_CLASSES:
            known = f": {', '.join(names)}" if names else ""
            raise FastARError(f"'{name}' is an ImageNet class, but this model has {cfg.num_classes} classes{known}; "
                              f"pick one of its classes or '{USE_INDEX}'")
    check_class_index(label, cfg.num_classes)
    if names:
        return label, f"class {label} ({names[label]})"
    if cfg.num_classes == IMAGENET_CLASSES:
        return label, f"class {label} ({imagenet_names()[label]})"
    return label, f"class {label}"


class ClassLabel(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        options = class_options()
        return io.Schema(
            node_id="FastARClassLabel",
            display_name="FastAR Class Label",
            category="FastAR/conditioning",
            description="The class to draw, for class-to-image models: the demo model's classes, the 1000 ImageNet "
                        "classes of LlamaGen c2i models, or a raw index.",
            inputs=[
                FastARModel.Input("model", tooltip="The class-to-image model the label is for (checks the class "
                                                   "exists in it)."),
                io.Combo.Input("class_name", options=options, default=options[1] if len(options) > 1 else USE_INDEX,
                               tooltip="Class to draw. '(demo N)' entries are the bundled demo model's classes; the "
                                       "others are ImageNet classes for 1000-class LlamaGen models. Pick "
                                       f"'{USE_INDEX}' to use the index below."),
                io.Int.Input("index", default=-1, min=-1, max=MAX_INDEX,
                             tooltip=f"Raw class index, used when class_name is '{USE_INDEX}' (-1 = not used). "
                                     "0..7 for the demo model, 0..999 for ImageNet models."),
            ],
            outputs=[FastARConditioning.Output("conditioning", display_name="conditioning",
                                               tooltip="Class conditioning for a FastAR sampler.")],
        )

    @classmethod
    def validate_inputs(cls, class_name, index):
        if not isinstance(index, int) or not isinstance(class_name, str):
            return True  # ComfyUI reports a value of the wrong type itself
        if class_name.startswith(REFUSED):
            return class_name[len(REFUSED):]
        return widget_error(class_name, index) or True

    @classmethod
    def execute(cls, model: ModelHandle, class_name, index) -> io.NodeOutput:
        label, text = resolve_class(model.module, class_name, index)
        rows = ClassConditioning(torch.tensor([label], dtype=torch.long))
        return io.NodeOutput(Conditioning("c2i", rows, text))


def check_class_labels(request: dict) -> dict:
    """ComfyUI on-prompt hook: before validation, a Class Label wired straight to a Load AR Model is
    checked against that model's classes, read off the checkpoint's header (no weights are loaded). A
    wrong class is marked so that validation refuses the prompt with the reason on the Class Label node,
    before anything runs. Checkpoints whose classes a header cannot tell (pickles) are checked when the
    node runs."""
    prompt = request.get("prompt") if isinstance(request, dict) else None
    if not isinstance(prompt, dict):
        return request
    for node in prompt.values():
        try:
            if not isinstance(node, dict) or node.get("class_type") != "FastARClassLabel":
                continue
            inputs = node.get("inputs", {})
            link, class_name, index = inputs.get("model"), inputs.get("class_name"), inputs.get("index", -1)
            loader = prompt.get(str(link[0])) if isinstance(link, list) and len(link) == 2 else None
            if not isinstance(loader, dict) or loader.get("class_type") != "FastARLoadModel":
                continue
            model_name = loader.get("inputs", {}).get("model_name")
            if not isinstance(model_name, str) or not isinstance(class_name, str) or class_name.startswith(REFUSED):
                continue
            if widget_error(class_name, int(index)):
                continue  # the node's own validation says what is wrong
            if load_error(model_name, files.AR):
                continue  # the loader's own validation reports it, on its input
            info = files.class_info(files.resolve(model_name, files.AR))
            if info is None:
                continue
            cfg = SimpleNamespace(num_classes=info["num_classes"], class_names=info["class_names"])
            kind = "caption" if info["model_type"] == "t2i" else "class"
            resolve_class(SimpleNamespace(cfg=cfg, conditioning_kind=kind), class_name, int(index))
        except FastARError as e:
            inputs["class_name"] = f"{REFUSED}{e} (model: {model_name})"
        except Exception:  # noqa: BLE001 - never break a prompt over a pre-check; the run checks again
            continue
    return request


# -- text ------------------------------------------------------------------------------------------


def negative_prompt_error(model, negative_prompt: str) -> str | None:
    """Why a negative prompt cannot go with ``model`` (the command line's reasons, naming the node's input)."""
    kind = conditioning_type(model)
    if not negative_prompt.strip() or getattr(model, "takes_negative_prompt", False) or kind == "c2i":
        return None  # a class model: the node says to use FastAR Class Label
    if kind == "prompt":
        return (f"this is {model.what}, whose release guides CFG without a negative prompt: leave negative_prompt "
                "empty")
    return f"negative prompts are for Emu3 models; this is {model.what}: leave negative_prompt empty"


class TextConditioning(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="FastARTextConditioning",
            display_name="FastAR Text Conditioning",
            category="FastAR/conditioning",
            description="The prompt for text-to-image models: Lumina-mGPT, Anole, Janus-Pro and Emu3 read it with "
                        "their own tokenizer; LlamaGen t2i and Infinity read it through a local FLAN-T5-XL folder. "
                        "Nothing is downloaded. Emu3 also takes a negative prompt, what CFG guides away from.",
            inputs=[
                FastARModel.Input("model", tooltip="The text-to-image model the prompt is for."),
                io.String.Input("prompt", multiline=True, default="a photo of a red apple on a wooden table",
                                tooltip="What to draw. LlamaGen t2i reads up to 120 T5 tokens, Infinity 512."),
                io.Combo.Input("t5_folder", options=[*files.t5_choices(), NO_T5],
                               tooltip="LlamaGen t2i and Infinity: the google/flan-t5-xl folder (config.json, tokenizer, "
                                       "weights) in models/fastar or models/text_encoders. Models with their own "
                                       f"tokenizer (Lumina-mGPT, Anole, Janus-Pro, Emu3) take '{NO_T5}'."),
                # optional and last: prompts saved before it existed stay valid
                io.String.Input("negative_prompt", multiline=True, default="", optional=True,
                                tooltip="Emu3: what CFG guides away from (with cfg above 1), read like the prompt "
                                        "and given the same image header, as BAAI's generation example does. "
                                        "Empty: the release's published negative prompt (lowres, bad anatomy, "
                                        "... blurry). The other models' releases guide CFG without a negative "
                                        "prompt: leave it empty for them."),
            ],
            outputs=[FastARConditioning.Output("conditioning", display_name="conditioning",
                                               tooltip="Caption conditioning for a FastAR sampler.")],
        )

    @classmethod
    def validate_inputs(cls, t5_folder):
        """The folder alone (ComfyUI reports what this returns on every input it names): the prompt is checked
        when the node runs."""
        if t5_folder != NO_T5 and (error := load_error(t5_folder, files.T5)):
            return f"{error} (models that read the prompt themselves take '{NO_T5}')"
        return True

    @classmethod
    def execute(cls, model: ModelHandle, prompt, t5_folder, negative_prompt="") -> io.NodeOutput:
        from ..model_loaders.llamagen.t5 import captions_for, load_t5_encoder

        if not prompt.strip():
            raise FastARError("the prompt is empty: describe the image to draw")
        kind = conditioning_type(model.module)
        short = prompt.strip().splitlines()[0][:60]
        raise_if(negative_prompt_error(model.module, negative_prompt))
        if kind == "prompt":
            rows = PromptConditioning([prompt], [negative_prompt] if negative_prompt.strip() else None)
            return io.NodeOutput(Conditioning("prompt", rows, f"text: {short}"))
        if kind != "t2i":
            raise FastARError("this is a class-to-image model: use FastAR Class Label, not FastAR Text Conditioning")
        if t5_folder == NO_T5:
            raise FastARError(f"{model.name} reads the prompt through FLAN-T5-XL: download "
                              "google/flan-t5-xl as a folder into models/fastar or models/text_encoders, press R and "
                              "pick it as t5_folder")
        folder = files.resolve(t5_folder, files.T5)
        device = glue.load_device()
        # bf16 where ComfyUI would use it, else fp32: T5 overflows in fp16
        dtype = torch.bfloat16 if glue.choose_dtype("auto", device) == torch.bfloat16 else torch.float32
        on_disk = sum(f.stat().st_size for f in folder.iterdir() if f.suffix in (".safetensors", ".bin"))
        glue.make_room(on_disk * (2 if dtype == torch.float32 else 1))
        encoder = load_t5_encoder(folder, device=device, dtype=dtype)
        try:
            rows = captions_for(model.module, encoder, [prompt])
        finally:
            del encoder
            glue.free_cache()
        rows.embeddings, rows.mask = rows.embeddings.float().cpu(), rows.mask.cpu()
        return io.NodeOutput(Conditioning("t2i", rows, f"text: {short}"))
