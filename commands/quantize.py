"""``python -m fastar quantize``: a model's 8-bit weights written once, to load directly later (half the bytes to
read and store, nothing to quantise at each load).

What is written is what quantising at load puts into the model (quantized.py), in the checkpoint's own layout as
FastAR reads it: the loader's keys (official names; joined layers split into their release parts), each 8-bit
layer's weight as its codes beside ``<key>_scale`` (fp32, one per output row), every other tensor as the
checkpoint stores it, and ``fastar_weights`` in the metadata. Codes are quantised from the stored precision, so
they are those of quantising at load in fp32 (or in the stored dtype). A file gets its loader's config as
``fastar_config`` (so its image size and head count no longer depend on its name or its training args); a model
folder (Chameleon family, Janus, Emu3) becomes a folder: its config and tokenizer files copied, the weights in one
``model.safetensors`` (a Janus folder's VQ decoder with them, under the original layout's names; an Emu3 folder's in
transformers' layout under ``vqmodel.*``).
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

from ..errors import FastARError

WEIGHTS_FILE = "model.safetensors"


def default_out(source: Path, fmt: str) -> Path:
    """Beside the source, named after it: ``c2i_XL_384-int8.safetensors``, ``Lumina-mGPT-7B-768-int8/``."""
    if source.is_dir():
        return source.with_name(f"{source.name}-{fmt}")
    return source.with_name(f"{source.stem}-{fmt}.safetensors")


def quantised_tensors(source: Path, fmt: str, image_size: int | None):
    """The family and model loaded from ``source`` in ``fmt`` (int8 or fp8), the tensors to write and the
    checkpoint's info."""
    from ..model_loaders import EMBEDDED_VQ, LOADERS, embedded_image_decoder
    from ..model_loaders.janus.loader import is_converted, vq_of_janus
    from ..model_loaders.shared.checkpoint import AR_MODEL, read_state_dict, recording_weights, require_family
    from ..model_loaders.shared.joined import joined_parts, parted
    from ..model_loaders.shared.quantized import STORED_FORMAT, quantised_loading

    sd, info = read_state_dict(source)
    family = require_family(sd, info.source, AR_MODEL)
    if STORED_FORMAT in info.metadata:
        raise FastARError(f"{info.source} holds {info.metadata[STORED_FORMAT]} weights already: quantise the "
                          "full-precision checkpoint")
    size = {} if image_size is None else {"image_size": image_size}
    with quantised_loading(fmt, None), recording_weights() as state:  # None: from the stored precision
        model = LOADERS[family](sd, info=info, device="cpu", dtype=None, **size)
    tensors = parted(state, joined_parts(model))
    if family == "janus":  # the folder's VQ decoder, which load_image_decoder finds under the original names
        tensors |= {f"gen_vision_model.{k}": v for k, v in vq_of_janus(sd, is_converted(sd)).items()}
    if family == "emu3" and any(k.startswith(EMBEDDED_VQ) for k in sd):  # transformers' layout: its VQ model too
        tensors |= {f"vqmodel.{k}": v for k, v in embedded_image_decoder(sd, info).items()}
    return family, model, {k: v.contiguous() for k, v in tensors.items()}, info


def write_quantised(source, fmt: str, out=None, image_size: int | None = None) -> Path:
    """Write ``source`` (a checkpoint file or model folder of an AR model) with its blocks' linear layers in
    ``fmt`` to ``out`` (default: beside it, see ``default_out``); returns where it went."""
    from ..model_loaders.shared.quantized import CODE_DTYPES, STORED_FORMAT
    from .training import write_whole

    if fmt not in CODE_DTYPES:
        raise FastARError(f"weight format {fmt!r}: choose int8 or fp8")
    source = Path(source)
    out = Path(out) if out else default_out(source, fmt)
    if out.exists():
        raise FastARError(f"{out} exists already: remove it, or choose another --out")
    if source.is_dir() and out.suffix:
        raise FastARError(f"{source.name} is a model folder, so its 8-bit copy is a folder too: give --out a folder "
                          f"name (not {out.name})")
    if not source.is_dir() and out.suffix.lower() != ".safetensors":
        raise FastARError(f"--out {out.name}: the 8-bit copy of a file is a .safetensors file")
    family, model, tensors, info = quantised_tensors(source, fmt, image_size)
    metadata = {**info.metadata, STORED_FORMAT: fmt}
    if source.is_dir():
        partial = out.with_name(f"{out.name}.{os.getpid()}.partial")
        try:
            copy_folder_files(source, partial, info.config | folder_config(family, model, info.config))
            save_readable(tensors, partial / WEIGHTS_FILE, metadata)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        partial.rename(out)
    else:
        metadata["fastar_config"] = json.dumps(asdict(model.cfg))
        out.parent.mkdir(parents=True, exist_ok=True)
        write_whole(out, lambda file: save_readable(tensors, file, metadata))
    return out


def save_readable(tensors: dict, path: Path, metadata: dict) -> None:
    """safetensors' file, readable by others as files usually are (it creates them for the owner alone), so that a
    ComfyUI running as another user can load it."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    path.chmod(0o644)


def folder_config(family: str, model, config: dict) -> dict:
    """What a written folder's config.json adds: a Chameleon-family model's image size (else read off the folder's
    name, which the copy may not keep)."""
    from ..model_loaders.chameleon.loader import token_pixels

    return {"image_size": model.cfg.grid[0] * token_pixels(config)} if family == "chameleon" else {}


def copy_folder_files(source: Path, out: Path, config: dict) -> None:
    """Every file of the model folder but its weights and their index (tokenizer, generation settings), and
    ``config``."""
    from ..model_loaders.shared.checkpoint import FOLDER_INDEXES, WEIGHT_SUFFIXES

    out.mkdir(parents=True)
    for file in source.iterdir():
        if file.is_file() and file.suffix.lower() not in WEIGHT_SUFFIXES and file.name not in FOLDER_INDEXES:
            shutil.copy2(file, out / file.name)
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def command_quantize(args) -> int:
    start = time.perf_counter()
    out = write_quantised(args.model, args.weights, args.out, args.image_size)
    before, after = folder_bytes(Path(args.model)), folder_bytes(out)
    print(f"wrote {out}: {after / 1e9:.2f} GB ({args.weights}; the source: {before / 1e9:.2f} GB) in "
          f"{time.perf_counter() - start:.1f} s. Load it as any model (--model, FastAR Load AR Model): its blocks "
          f"load in {args.weights}, with nothing to quantise")
    return 0
