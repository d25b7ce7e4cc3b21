"""Model files and folders in ComfyUI's ``fastar`` and ``fastar_drafters`` model folders: registration,
listing, resolving, and a cheap look at a checkpoint (safetensors header only) so lists and validation do
not load weights.

Users' own ``fastar:``/``fastar_drafters:`` paths from extra_model_paths.yaml are kept; ``models/fastar``
and ``models/fastar_drafters`` are added, and the pack's bundled ``demo/`` folder comes last in ``fastar``,
so the demo models (and the demo drafter folder) are always in the lists.
"""
from __future__ import annotations

import json
import os
import struct
from functools import lru_cache
from pathlib import Path, PureWindowsPath

import folder_paths

from ..errors import FastARError
from ..model_loaders.shared.checkpoint import AR_MODEL, DRAFTER as CHECKPOINT_DRAFTER, FAMILY_KIND, IMAGE_DECODER, detect_family
from ..model_loaders.shared.demo import DEMO_AR, DEMO_DIR, DEMO_MAR_DRAFT

FOLDER = "fastar"
DRAFTER_FOLDER = "fastar_drafters"
T5_FOLDERS = (FOLDER, "text_encoders")
DRAFTER_FOLDERS = (DRAFTER_FOLDER, FOLDER)  # drafter folders users keep beside their models are found too
WEIGHT_SUFFIXES = {".safetensors", ".pt", ".pth", ".bin", ".ckpt"}
WEIGHT_FILES_IN_FOLDER = ("model.safetensors.index.json", "pytorch_model.bin.index.json", "model.safetensors",
                          "pytorch_model.bin")

AR, VQ, T5, DRAFTER = "ar", "vq", "t5", "drafter"
KIND_NAMES = {AR: "AR model", VQ: "image decoder", T5: "FLAN-T5 folder", DRAFTER: "drafter"}
FOLDERS_OF = {AR: (FOLDER,), VQ: (FOLDER,), T5: T5_FOLDERS, DRAFTER: DRAFTER_FOLDERS}
INPUT_OF = {AR: "model_name", VQ: "vq_name", T5: "t5_folder", DRAFTER: "drafter_name"}  # the loaders' inputs


def where(kind: str) -> str:
    """Where to put a ``kind``: every folder its list shows it from (drafters: fastar_drafters alone, as the fastar
    folders list EAGLE drafter folders only)."""
    folders = (DRAFTER_FOLDER,) if kind == DRAFTER else FOLDERS_OF[kind]
    return (f"put it in ComfyUI's {' or '.join(f'models/{f}' for f in folders)} folder (or a "
            f"{' or '.join(f'{f}:' for f in folders)} path in extra_model_paths.yaml) and press R to refresh the lists")


def register_model_folders() -> None:
    """Add ``models/fastar`` and ``models/fastar_drafters`` (each the default unless the user declared
    paths for it already) and the bundled demo folder, without touching paths users declared."""
    for name in (FOLDER, DRAFTER_FOLDER):
        declared = name in folder_paths.folder_names_and_paths
        folder_paths.add_model_folder_path(name, os.path.join(folder_paths.models_dir, name), is_default=not declared)
        if name == FOLDER:
            folder_paths.add_model_folder_path(name, str(DEMO_DIR))
        extensions = folder_paths.folder_names_and_paths[name][1]
        if isinstance(extensions, set):
            extensions.update(WEIGHT_SUFFIXES)


def folder_roots(names=(FOLDER,)) -> list[Path]:
    roots = []
    for name in names:
        try:
            roots += [Path(p) for p in folder_paths.get_folder_paths(name)]
        except KeyError:  # a folder name this ComfyUI does not know
            continue
    return roots


# -- a cheap look inside ---------------------------------------------------------------------------


@lru_cache(maxsize=512)
def _safetensors_header(path: str, mtime: float, size: int) -> dict | None:
    try:
        with open(path, "rb") as f:
            length = struct.unpack("<Q", f.read(8))[0]
            if length > min(size, 100_000_000):
                return None
            return json.loads(f.read(length))
    except (OSError, struct.error, ValueError):
        return None


def safetensors_header(path: Path) -> dict | None:
    """The JSON header of a safetensors file (tensor names, shapes, ``__metadata__``), or None."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return _safetensors_header(str(path), stat.st_mtime, stat.st_size)


NODE_KIND = {AR_MODEL: AR, IMAGE_DECODER: VQ, CHECKPOINT_DRAFTER: DRAFTER}


def header_kind(header: dict) -> str | None:
    """AR, VQ (any image decoder: VQ tokenizer or KL autoencoder) or DRAFTER, by the loaders' own family
    detection on the tensor names; None for a file of no family FastAR knows."""
    family = detect_family(header)
    return NODE_KIND[FAMILY_KIND[family]] if family else None


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


IMAGE_DECODER_FOLDERS = ("Emu3VisionVQ",)  # config.json model_type of image decoder folders (BAAI's VisionTokenizer)
DECODER_CARRIERS = ("janus", "multi_modality", "emu3")  # model_type of model folders that hold their image decoder


def folder_kind(folder: Path) -> str | None:
    """AR for a model folder (config.json/index + weights of any supported suffix), T5 for a T5 encoder folder, DRAFTER for an
    EAGLE drafter folder (LANTERN's format keeps the base model's config.json with one layer), VQ for an image
    decoder folder (Emu3's VisionTokenizer), else None."""
    config = read_json(folder / "config.json") if (folder / "config.json").is_file() else None
    if config is not None and config.get("model_type") in IMAGE_DECODER_FOLDERS:
        return VQ
    if config is not None and (config.get("model_type") == "t5" or "T5" in " ".join((config.get("architectures") or []))):
        return T5
    if (folder / "spiece.model").is_file():
        return T5
    if config is not None and config.get("num_hidden_layers") == 1:
        return DRAFTER
    if any((folder / name).is_file() for name in WEIGHT_FILES_IN_FOLDER):
        return AR
    if config is not None and any(p.is_file() and p.suffix.lower() in WEIGHT_SUFFIXES for p in folder.iterdir()):
        return AR  # config.json + a weights file of any name (my_gpt.pt), as the loader reads it
    return None


def holds_image_decoder(folder: Path) -> bool:
    """A model folder that carries its own image decoder (Janus: the VQ-16 inside the checkpoint; transformers'
    Emu3: its VQ model beside the text model; BAAI's Emu3-Gen keeps it in another folder, model_type "Emu3")."""
    config = read_json(folder / "config.json") if (folder / "config.json").is_file() else None
    return config is not None and (config.get("model_type") in DECODER_CARRIERS
                                   or "MultiModalityCausalLM" in (config.get("architectures") or []))


def file_kind(path: Path) -> str | None:
    """AR, VQ or DRAFTER for a safetensors file whose keys say so; None for other safetensors files; "?" for
    pickles (their keys cannot be read without loading them)."""
    if path.suffix.lower() == ".safetensors":
        header = safetensors_header(path)
        return header_kind(header) if header else "?"
    return "?" if path.suffix.lower() in WEIGHT_SUFFIXES else None


# -- lists -----------------------------------------------------------------------------------------


def model_folders(roots: list[Path], *kinds: str) -> list[tuple[str, Path]]:
    """HF-style folders of ``kinds`` up to two levels below each root, named ``relative/path/``."""
    found = []
    for root in roots:
        if not root.is_dir():
            continue
        for first in sorted(p for p in root.iterdir() if p.is_dir()):
            for folder in (first, *sorted(p for p in first.iterdir() if p.is_dir())):
                if folder_kind(folder) in kinds:
                    found.append((folder.relative_to(root).as_posix() + "/", folder))
    return found


def entries(folder: str, file_kinds: tuple, folder_kinds: tuple) -> list[str]:
    """Files of ``file_kinds`` ("?" = pickles, which cannot be told apart without loading), then HF-style
    folders of ``folder_kinds``, in one registered model folder. Files inside model folders are not listed."""
    roots = folder_roots((folder,))
    inside = tuple(name for name, _ in model_folders(roots, AR, T5, DRAFTER, VQ))
    names = []
    for name in folder_paths.get_filename_list(folder):
        if name.replace(os.sep, "/").startswith(inside) or name in names:
            continue
        path = folder_paths.get_full_path(folder, name)
        if path and file_kind(Path(path)) in file_kinds:
            names.append(name)
    return names + [name for name, _ in model_folders(roots, *folder_kinds)]


def unique(names: list[str]) -> list[str]:
    return list(dict.fromkeys(names))


def choices(kind: str) -> list[str]:
    """The names shown in a loader's list. Drafters: anything in the drafter folders (EAGLE drafters and
    smaller AR models), plus EAGLE drafters kept in the fastar folders (the bundled demo drafter) and the
    bundled demo MAR's draft model."""
    if kind == DRAFTER:
        bundled = [DEMO_MAR_DRAFT.name] if folder_paths.get_full_path(FOLDER, DEMO_MAR_DRAFT.name) else []
        return unique(entries(DRAFTER_FOLDER, (DRAFTER, AR, "?"), (DRAFTER, AR)) + entries(FOLDER, (DRAFTER,), (DRAFTER,))
                      + bundled)
    if kind == VQ:  # plus image decoder folders and model folders that carry their image decoder
        carriers = [name for name, path in model_folders(folder_roots((FOLDER,)), AR) if holds_image_decoder(path)]
        return entries(FOLDER, (VQ, "?"), (VQ,)) + carriers
    return entries(FOLDER, (kind, "?"), (AR,) if kind == AR else ())


def t5_choices() -> list[str]:
    return unique([name for name, _ in model_folders(folder_roots(T5_FOLDERS), T5)])


def leaves_its_folder(name: str) -> bool:
    """Whether a name a workflow gives reaches outside the model folder it is looked up in: an absolute name (a
    root, a drive, a share) or one with a '..' part, read with either separator on every OS. Any '..' counts, not
    only one that climbs above the folder on paper: after a link, '..' climbs from the link's target, which the
    name does not show. Links the user made inside the model folders are followed, as ComfyUI's own lists follow
    them (a collection kept on another disk, a Hugging Face download whose files link into its cache): a workflow
    names a path but cannot make a link, so it reaches only what the user put into their model folders."""
    path = PureWindowsPath(name)  # both separators and drives, on every OS
    # a part of dots and spaces alone climbs: Windows drops a part's trailing dots and spaces (".. " is "..")
    return bool(path.anchor) or any(not part.strip(". ") for part in path.parts)


def resolve(name: str, kind: str) -> Path:
    """The full path of a list entry of ``kind``; a FastARError that says what to do otherwise. A name that
    leaves the model folders is refused before anything is looked up, here as in the loaders' validation: ComfyUI's
    get_full_path does not refuse it (it reads '../../x' and '/x' as 'x', another file than the name says)."""
    if leaves_its_folder(name):
        raise FastARError(f"{INPUT_OF[kind]} '{name}' leaves ComfyUI's model folders, and FastAR reads models only "
                          f"from them: pick an entry of the list, or {where(kind)}")
    if name.endswith("/"):
        for root in folder_roots(FOLDERS_OF[kind]):
            if (root / name).is_dir():
                return root / name.rstrip("/")
    else:
        for folder in FOLDERS_OF[kind]:
            path = folder_paths.get_full_path(folder, name)
            if path is not None:
                return Path(path)
    raise FastARError(f"no {KIND_NAMES[kind]} named '{name}' in the model folders: {where(kind)}")


def fingerprint(path: Path):
    """Changes when the file (or a folder's files) changes on disk, so ComfyUI reloads it."""
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else []
    out = []
    for p in files:
        try:
            stat = p.stat()
            out.append((p.name, stat.st_size, stat.st_mtime))
        except OSError:
            continue
    return (str(path), tuple(out))


def demo_class_names() -> list[str]:
    """The demo model's class names (from its metadata), or none when it is not there."""
    candidates = [DEMO_AR]
    other = folder_paths.get_full_path(FOLDER, DEMO_AR.name)
    if other:
        candidates.insert(0, Path(other))
    for path in candidates:
        header = safetensors_header(path) if path.is_file() else None
        config = (header or {}).get("__metadata__", {}).get("fastar_config")
        if config:
            try:
                return list(json.loads(config).get("class_names") or [])
            except ValueError:
                continue
    return []


def class_info(path: Path) -> dict | None:
    """``model_type``, ``num_classes`` and ``class_names`` of an AR checkpoint, when its safetensors header
    (or an HF folder's shard headers) tells; None when only loading it would (pickles)."""
    if path.is_dir():
        headers = [safetensors_header(p) for p in sorted(path.glob("*.safetensors"))]
    elif path.suffix.lower() == ".safetensors":
        headers = [safetensors_header(path)]
    else:
        return None
    for header in headers:
        if not header:
            continue
        config = header.get("__metadata__", {}).get("fastar_config")
        if config:
            try:
                saved = json.loads(config)
                return {"model_type": saved.get("model_type", "c2i"), "num_classes": saved.get("num_classes", 1000),
                        "class_names": list(saved.get("class_names") or [])}
            except ValueError:
                return None
        for prefix in ("", "model."):
            table = header.get(f"{prefix}cls_embedding.embedding_table.weight")
            if table:
                return {"model_type": "c2i", "num_classes": table["shape"][0] - 1, "class_names": []}
            if f"{prefix}cls_embedding.cap_proj.fc1.weight" in header:
                return {"model_type": "t2i", "num_classes": 0, "class_names": []}
    return None


ACCEPTED = {AR: (AR,), VQ: (VQ,), DRAFTER: (DRAFTER, AR)}  # a smaller AR model of the family drafts too
LOADED_BY = {AR: "an AR model (load it with FastAR Load AR Model)",
             VQ: "an image decoder (load it with FastAR Load Image Decoder)",
             DRAFTER: "a drafter (load it with FastAR Load Drafter)"}


def checkpoint_kind_error(path: Path, kind: str) -> str | None:
    """A readable reason why ``path`` is not a ``kind`` checkpoint, when a header look can tell."""
    if kind == T5:
        if path.is_dir() and folder_kind(path) == T5:
            return None
        return (f"{path.name} is no FLAN-T5 folder (one holds a config.json of model_type t5, the tokenizer and "
                "the weights, as google/flan-t5-xl is downloaded)")
    wanted = LOADED_BY[kind].split(" (")[0]
    if path.is_dir():
        found = folder_kind(path)
        if found == T5:
            return f"{path.name}/ is a T5 text encoder folder: pick it in FastAR Text Conditioning, not here"
        if found == DRAFTER and kind != DRAFTER:
            return f"{path.name}/ is {LOADED_BY[DRAFTER]}, not {wanted}"
        if found == VQ and kind != VQ:
            return f"{path.name}/ is {LOADED_BY[VQ]}, not {wanted}"
        return None
    if path.suffix.lower() != ".safetensors":
        return None
    header = safetensors_header(path)
    if header is None:
        return f"{path.name} is not a readable safetensors file: it is truncated or corrupt, re-download it"
    found = header_kind(header)
    if found in ACCEPTED[kind]:
        return None
    if found is None:
        return f"{path.name} is no AR model, image decoder or drafter FastAR knows"
    return f"{path.name} is {LOADED_BY[found]}, not {wanted}"
