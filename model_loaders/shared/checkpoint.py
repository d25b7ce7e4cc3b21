"""Reading checkpoint files safely: one state dict of tensors plus what was saved beside it.

Formats: ``.safetensors`` (with its metadata), pickled ``.pt/.pth/.bin/.ckpt`` through
``torch.load(weights_only=True)`` with a one-entry allow-list (``argparse.Namespace``, for the training
args), and model folders (``config.json`` + one weights file of any of these kinds, or sharded weights).
A file may carry its config beside it as ``NAME.json`` (for ``NAME.pt``). Wrapper dicts are unwrapped,
a DDP ``module.`` prefix is stripped and cache buffers are dropped. The family is read off the keys.
"""
from __future__ import annotations

import argparse
import contextlib
import contextvars
import json
import pickle
import re
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from ...errors import FastARError
from .joined import JoinedWeights, joined_parts, missing_parts, stored_shapes
from .quantized import is_codes, load_quantiser, loading_state

PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
WEIGHT_SUFFIXES = (".safetensors", *PICKLE_SUFFIXES)
SAFE_GLOBALS = [argparse.Namespace]

# Where the weights sit inside a saved dict, most preferred first: EMA weights over raw training weights.
WRAPPERS = (("ema",), ("model_ema",), ("trainer", "ema_parameters"), ("trainer", "gpt_fsdp"),
            ("model",), ("module",), ("state_dict",),
            ("vae",))  # Infinity's VAE files
KEY_PREFIXES = ("module.", "_orig_mod.")  # DDP and torch.compile wrappers
CACHE_BUFFER = re.compile(r"(^|\.)kv_cache\.|(^|\.)(freqs_cis|causal_mask|inv_freq)$")

# Model folders: an index of shards, the HF weights names, or the one weights file there is.
FOLDER_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
FOLDER_SINGLE_FILES = ("model.safetensors", "pytorch_model.bin")

MODELS_HINT = ("check the path (a checkpoint file or a model folder); in ComfyUI, models go in its models/fastar "
               "folder. FastAR's docs/models.md lists each model's files, where to get them and where they go")
CORRUPT_HINT = "the file is truncated or corrupt: re-download it"

AR_MODEL = "an AR model"
IMAGE_DECODER = "an image decoder"  # VQ tokenizer or KL autoencoder: what turns model outputs into pixels
DRAFTER = "an EAGLE-style drafter"
LOAD_AS = {
    AR_MODEL: "load it as the AR model (the model loader), not as the image decoder",
    IMAGE_DECODER: "load it as the image decoder (the VQ / image decoder loader, --vq), not as the AR model",
    DRAFTER: "load it as a drafter (FastAR Load Drafter, or --drafter) for the AR model it was trained with",
}


@dataclass
class CheckpointInfo:
    """What came with the weights."""

    source: str  # how messages name the checkpoint
    metadata: dict[str, str] = field(default_factory=dict)  # safetensors metadata
    args: dict | None = None  # training args saved beside the weights
    config: dict | None = None  # config.json of an HF-style folder
    folder: Path | None = None  # the model folder, for what lies beside the weights (tokenizer files)

    def settings(self) -> dict:
        """Training args and config.json merged (args win): the named hyper-parameters we know."""
        return {**(self.config or {}), **(self.args or {})}

    def fastar_config(self) -> dict | None:
        """The ``fastar_config`` JSON that FastAR writes into the safetensors metadata of its models."""
        text = self.metadata.get("fastar_config")
        if text is None:
            return None
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise FastARError(f"{self.source}: its fastar_config metadata is not valid JSON ({e}); {CORRUPT_HINT}")


    def fastar_defaults(self) -> dict:
        """The model's own sampling defaults, its best measured settings, which FastAR writes into the safetensors
        metadata of the models it makes (``fastar_defaults``: ``cfg``, ``num_iter``, ... by the command line's
        names); empty for other checkpoints, which keep their release's defaults."""
        text = self.metadata.get("fastar_defaults")
        if text is None:
            return {}
        try:
            defaults = json.loads(text)
        except json.JSONDecodeError as e:
            raise FastARError(f"{self.source}: its fastar_defaults metadata is not valid JSON ({e}); {CORRUPT_HINT}")
        unknown = set(defaults) - set(DEFAULT_SETTINGS) if isinstance(defaults, dict) else {"(not an object)"}
        if unknown:
            raise FastARError(f"{self.source}: its fastar_defaults metadata holds {', '.join(sorted(unknown))}, which no "
                              f"FastAR setting is named ({', '.join(DEFAULT_SETTINGS)} are); {CORRUPT_HINT}")
        return defaults


DEFAULT_SETTINGS = ("cfg", "temperature", "top_k", "top_p", "num_iter", "diffusion_steps", "cfg_schedule")


def read_state_dict(path) -> tuple[dict[str, torch.Tensor], CheckpointInfo]:
    """The weights of a checkpoint file or HF-style folder, cleaned, with what was saved beside them."""
    path = Path(path)
    if not path.exists():
        where = "" if path.is_absolute() else f" (looked for in {Path.cwd()})"
        raise FastARError(f"no checkpoint at {path}{where}: {MODELS_HINT}")
    if path.is_dir():
        return read_folder(path)
    info = CheckpointInfo(source=path.name, config=read_json(path.with_suffix(".json")))
    suffix = path.suffix.lower()
    if suffix not in WEIGHT_SUFFIXES:
        raise FastARError(
            f"{path.name}: unknown checkpoint type {path.suffix!r}; FastAR reads .safetensors, "
            f"{'/'.join(PICKLE_SUFFIXES)} files and model folders (docs/models.md lists each model's files)"
        )
    tensors = read_weights_file(path, info)
    return clean_state_dict(tensors, info.source), info


def check_weights_format(path: Path) -> None:
    """Refuse a file that is no weights file at all (a web page saved under the model's name, a text file), which
    would otherwise read as a damaged one: a safetensors file starts with its header's length and then '{', a
    PyTorch file is a zip archive or a pickle (protocol byte 0x80)."""
    with open(path, "rb") as f:
        head = f.read(64)
    if head.startswith(b"version https://git-lfs"):
        raise FastARError(f"{path.name} is a Git LFS pointer, not the weights: fetch the file itself (git lfs pull in "
                          "the clone, or the download link of the file)")
    if not head:
        raise FastARError(f"{path.name} is empty: {CORRUPT_HINT}")
    if path.suffix.lower() == ".safetensors":
        looks_right = len(head) >= 9 and head[8:9] == b"{"
    else:
        looks_right = head.startswith(b"PK") or head[:1] == b"\x80"
    if not looks_right:
        kind = "safetensors" if path.suffix.lower() == ".safetensors" else "PyTorch checkpoint"
        raise FastARError(f"{path.name} is not a {kind} file at all (it starts with {head[:8]!r}): the download may "
                          "have saved a web page or an error message instead; download the weights file itself")


def read_weights_file(path: Path, info: CheckpointInfo) -> dict[str, torch.Tensor]:
    """The tensors of one weights file; its metadata or training args go into ``info`` (first file wins)."""
    check_weights_format(path)
    if path.suffix.lower() == ".safetensors":
        tensors, metadata = read_safetensors(path)
        info.metadata = info.metadata or metadata
        return tensors
    tensors, args = unwrap_checkpoint(read_pickle(path))
    info.args = info.args or args
    return tensors


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    except SafetensorError as e:
        raise FastARError(f"{path.name}: {CORRUPT_HINT} ({e})") from e


def read_pickle(path: Path):
    """``torch.load`` restricted to tensors, plain containers and the allow-list; never runs code."""
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except (PermissionError, FileNotFoundError, MemoryError):
        raise
    except pickle.UnpicklingError as e:
        refused = re.search(r"GLOBAL (\S+)", str(e))
        if refused:
            raise FastARError(
                f"{path.name} needs the Python object {refused.group(1)} to load, which is refused for safety "
                "(loading it could run arbitrary code). Convert the checkpoint to .safetensors in a trusted "
                "environment, or use a safetensors release of the model"
            ) from e
        raise FastARError(f"{path.name}: {CORRUPT_HINT}") from e
    except Exception as e:  # noqa: BLE001 - a damaged pickle stream can fail in any way (KeyError, IndexError, ...)
        raise FastARError(f"{path.name}: {CORRUPT_HINT} ({type(e).__name__}: {e})") from e


def read_folder(folder: Path) -> tuple[Mapping[str, torch.Tensor], CheckpointInfo]:
    """A folder's weights; safetensors shards are not read until a tensor is asked for (``ShardedWeights``),
    so that a model of many GB is loaded tensor by tensor, in its own dtype, where it goes."""
    info = CheckpointInfo(source=folder.name, config=read_json(folder / "config.json"), folder=folder)
    files = folder_weight_files(folder)
    if all(f.suffix.lower() == ".safetensors" for f in files):
        weights = ShardedWeights(files, info.source)
        info.metadata = weights.metadata
        return weights.select(clean_names(weights, info.source)), info
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(read_weights_file(file, info))
    return clean_state_dict(tensors, info.source), info


class ShardedWeights(Mapping):
    """The tensors of safetensors shards, each read from disk when asked for. ``select`` gives a view with
    some keys, renamed (``{new name: stored name}``)."""

    def __init__(self, files: list[Path], source: str, names: dict[str, str] | None = None,
                 where: dict[str, Path] | None = None):
        self.source = source
        self.metadata: dict[str, str] = {}
        if where is None:
            where = {}
            for file in files:
                try:
                    with safe_open(str(file), framework="pt", device="cpu") as f:
                        where.update(dict.fromkeys(f.keys(), file))
                        self.metadata = self.metadata or dict(f.metadata() or {})
                except SafetensorError as e:
                    raise FastARError(f"{file.name}: {CORRUPT_HINT} ({e})") from e
        self.where = where
        self.names = names if names is not None else {k: k for k in where}

    def select(self, names: dict[str, str]) -> "ShardedWeights":
        view = ShardedWeights([], self.source, {new: self.names[old] for new, old in names.items()}, self.where)
        view.metadata = self.metadata
        return view

    def __getitem__(self, key: str) -> torch.Tensor:
        stored = self.names[key]
        try:
            with safe_open(str(self.where[stored]), framework="pt", device="cpu") as f:
                return f.get_tensor(stored)
        except SafetensorError as e:
            raise FastARError(f"{self.where[stored].name}: {CORRUPT_HINT} ({e})") from e

    def shape(self, key: str) -> tuple[int, ...]:
        stored = self.names[key]
        with safe_open(str(self.where[stored]), framework="pt", device="cpu") as f:
            return tuple(f.get_slice(stored).get_shape())

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, key) -> bool:
        return key in self.names


def folder_weight_files(folder: Path) -> list[Path]:
    for index_name in FOLDER_INDEXES:
        index = read_json(folder / index_name)
        if index is not None:
            shards = [folder / name for name in sorted(set(index.get("weight_map", {}).values()))]
            missing = [p.name for p in shards if not p.is_file()]
            if missing:
                raise FastARError(f"{folder.name}: {index_name} lists shards that are missing "
                                  f"({', '.join(missing)}): download every shard of the model (docs/models.md)")
            return shards
    for name in FOLDER_SINGLE_FILES:
        if (folder / name).is_file():
            return [folder / name]
    shards = sorted(folder.glob("*.safetensors"))
    if shards:  # shards without an index
        return shards
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in WEIGHT_SUFFIXES)
    if len(files) == 1:
        return files
    if files:
        raise FastARError(f"the folder {folder} holds several weights files ({', '.join(p.name for p in files)}) and "
                          "no index that says which belong together: keep one model's weights file in the folder")
    raise FastARError(
        f"the folder {folder} holds no weights: put the model's weights file ({', '.join(WEIGHT_SUFFIXES)}) beside "
        f"its config.json, or all shards with their index; {MODELS_HINT}"
    )


def read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FastARError(f"{path.parent.name}/{path.name} is not valid JSON ({e}): re-download it") from e


def unwrap_checkpoint(obj) -> tuple[dict[str, torch.Tensor], dict | None]:
    """The tensors of a loaded checkpoint object, found inside wrapper dicts, and its training args."""
    args = None
    while isinstance(obj, Mapping):
        saved = obj.get("args")
        if args is None and isinstance(saved, (argparse.Namespace, Mapping)):
            args = dict(vars(saved) if isinstance(saved, argparse.Namespace) else saved)
        wrapper = next((w for w in WRAPPERS if isinstance(nested(obj, w), Mapping)), None)
        if wrapper is None:
            return {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}, args
        obj = nested(obj, wrapper)
    return {}, args


def nested(obj: Mapping, keys: tuple[str, ...]):
    for key in keys:
        if not isinstance(obj, Mapping) or key not in obj:
            return None
        obj = obj[key]
    return obj


def clean_state_dict(tensors: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """Strip wrapper prefixes, drop cache buffers; refuse a checkpoint without weights."""
    return {new: tensors[old] for new, old in clean_names(tensors, source).items()}


def clean_names(keys, source: str) -> dict[str, str]:
    """``{clean name: stored name}``: wrapper prefixes stripped, cache buffers left out; a checkpoint without
    weights refused."""
    names = {k: k for k in keys}
    for prefix in KEY_PREFIXES:
        if names and all(k.startswith(prefix) for k in names):
            names = {k[len(prefix):]: old for k, old in names.items()}
    names = {k: old for k, old in names.items() if not CACHE_BUFFER.search(k)}
    if not names:
        raise FastARError(f"{source} holds no weights (no tensors found): pick the model's weights file, or "
                          "re-download it if it is damaged")
    return names


# -- families ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    name: str
    kind: str  # AR_MODEL, IMAGE_DECODER or DRAFTER
    what: str  # how messages call it: "a LlamaGen GPT"
    matches: Callable[[Mapping[str, torch.Tensor]], bool]


def has_suffix(sd, suffix: str) -> bool:
    return any(k.endswith(suffix) for k in sd)


def has_prefix(sd, prefix: str) -> bool:
    return any(k.startswith(prefix) for k in sd)


LLAMA_KEYS = {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight", "lm_head.weight"}

# First match wins: put more specific families above the ones they resemble.
FAMILIES = (
    Family("infinity", AR_MODEL, "an Infinity model",  # VAR's key names too (word_embed, lvl_embed, shared_ada_lin)
           lambda sd: has_prefix(sd, "text_proj_for_sos.") or "cfg_uncond" in sd),
    Family("var-dd", AR_MODEL, "a Distilled Decoding student (VAR-DD)",
           lambda sd: "lvl_embed.weight" in sd and "n_d_embed.weight" in sd),
    Family("var", AR_MODEL, "a VAR model",
           lambda sd: "lvl_embed.weight" in sd and "n_d_embed.weight" not in sd and has_suffix(sd, ".ada_lin.1.weight")),
    Family("llamagen-dd", AR_MODEL, "a Distilled Decoding student",
           lambda sd: "n_d_embed.weight" in sd and has_prefix(sd, "final_layer_conti.")),
    Family("llamagen-gpt", AR_MODEL, "a LlamaGen GPT",
           lambda sd: "tok_embeddings.weight" in sd and has_suffix(sd, ".attention.wqkv.weight")),
    Family("llamagen-gpt-hf", AR_MODEL, "a LlamaGen GPT",
           lambda sd: "model.embed_tokens.weight" in sd and has_prefix(sd, "model.cls_embedding.")),
    Family("janus", AR_MODEL, "a Janus-Pro model",
           lambda sd: "gen_head.vision_head.weight" in sd or "model.generation_head.vision_head.weight" in sd),
    Family("emu3", AR_MODEL, "an Emu3 model",
           lambda sd: "text_model.model.embed_tokens.weight" in sd or "model.text_model.embed_tokens.weight" in sd
           or (LLAMA_KEYS <= set(sd) and not has_suffix(sd, ".self_attn.q_norm.weight")
               and not has_prefix(sd, "model.cls_embedding."))),  # BAAI's layout: LLaMA's names (its loader checks)
    Family("chameleon", AR_MODEL, "a Chameleon-family model (Lumina-mGPT, Anole)",
           lambda sd: "model.embed_tokens.weight" in sd and has_suffix(sd, ".self_attn.q_norm.weight")),
    Family("mar", AR_MODEL, "a MAR model",
           lambda sd: "z_proj.weight" in sd and has_prefix(sd, "diffloss.net.")),
    Family("var-vqvae", IMAGE_DECODER, "a multi-scale VQVAE (VAR)",
           lambda sd: "quantize.embedding.weight" in sd and has_prefix(sd, "quantize.quant_resi.")),
    Family("llamagen-vq", IMAGE_DECODER, "a VQ tokenizer",
           lambda sd: "quantize.embedding.weight" in sd and has_prefix(sd, "decoder.conv_blocks.")),
    Family("emu3-vq", IMAGE_DECODER, "Emu3's vision tokenizer",
           lambda sd: "quantize.embedding.weight" in sd and has_prefix(sd, "decoder.time_res_stack.")),
    Family("chameleon-vqgan", IMAGE_DECODER, "a Chameleon VQGAN",
           lambda sd: "quantize.embedding.weight" in sd and has_prefix(sd, "decoder.up.")),
    Family("infinity-vae", IMAGE_DECODER, "Infinity's BSQ VAE",  # its quantiser's buffer, or its wrapped convs
           lambda sd: has_prefix(sd, "decoder.up.") and (has_prefix(sd, "quantizer.lfq.")
                                                         or "decoder.conv_in.conv.weight" in sd)),
    Family("kl-vae", IMAGE_DECODER, "a KL autoencoder",
           lambda sd: "post_quant_conv.weight" in sd and has_prefix(sd, "decoder.up.")),
    Family("eagle-drafter", DRAFTER, "an EAGLE-style drafter", lambda sd: "fc.weight" in sd and "embed_tokens.weight" in sd),
)
FAMILY_KIND = {f.name: f.kind for f in FAMILIES}
FAMILY_WHAT = {f.name: f.what for f in FAMILIES}


def detect_family(sd: Mapping[str, torch.Tensor]) -> str | None:
    """The family name of a state dict (see ``FAMILIES``), or None when no family matches."""
    return next((f.name for f in FAMILIES if f.matches(sd)), None)


def require_family(sd: Mapping[str, torch.Tensor], source: str, kind: str) -> str:
    """The family of ``sd``, which must be a ``kind`` (AR_MODEL, IMAGE_DECODER or DRAFTER)."""
    family = detect_family(sd)
    if family is None:
        supported = ", ".join(f.name for f in FAMILIES)
        raise FastARError(
            f"{source} is not a model FastAR knows: its keys ({sample_keys(sd)}) match none of the supported "
            f"families ({supported}). Check that you picked the right file: FastAR's docs/models.md lists the "
            "supported releases and their files"
        )
    if FAMILY_KIND[family] != kind:
        raise FastARError(f"{source} is {FAMILY_WHAT[family]} ({family}), not {kind}: "
                          f"{LOAD_AS[FAMILY_KIND[family]]}")
    return family


def sample_keys(keys, n: int = 4) -> str:
    """A few keys for an error message: 'a, b, c (and 12 more)'."""
    keys = list(keys)
    more = f" (and {len(keys) - n} more)" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more


def select(sd: Mapping, names: dict[str, str]) -> Mapping:
    """``sd`` with the keys of ``names`` (``{new name: name in sd}``), without reading shards."""
    return sd.select(names) if isinstance(sd, ShardedWeights) else {new: sd[old] for new, old in names.items()}


def renamed(sd: Mapping, rules) -> Mapping:
    """``sd`` with the first matching rule (``(compiled pattern, replacement)``) applied to each key; a rule to None
    drops the key; keys no rule matches stay as they are (shards are not read: see ``select``)."""
    names = {}
    for key in sd:
        rule = next(((pattern, new) for pattern, new in rules if pattern.search(key)), None)
        if rule is None:
            names[key] = key
        elif rule[1] is not None:
            names[rule[0].sub(rule[1], key, count=1)] = key
    return select(sd, names)


def shape_of(sd: Mapping, key: str) -> tuple[int, ...]:
    """Without reading the tensor where ``sd`` can say (shards, ``JoinedWeights``)."""
    return sd.shape(key) if hasattr(sd, "shape") else tuple(sd[key].shape)


def load_weights(model: nn.Module, sd: Mapping[str, torch.Tensor], source: str, device=None, dtype=None) -> None:
    """Put ``sd`` into ``model`` (built on the meta device) strictly: every key present, none extra, same
    shapes; otherwise a FastARError naming a few keys and what they suggest. Shards (``ShardedWeights``) go
    in tensor by tensor, each cast to ``dtype`` on ``device`` as it is read, so that host memory holds one
    tensor beyond the model (none of it when ``device`` is a GPU). A joined layer (joined.py) is filled from its
    parts, and the messages name the parts a checkpoint holds. Inside ``quantized.quantised_loading`` the blocks'
    layers take 8-bit codes and scales made from each weight as it is read."""
    quantiser = load_quantiser(model, dtype)  # first: its 8-bit layers change what the model expects
    expected, parts = model.state_dict(), joined_parts(model)
    stored, sd = sd, JoinedWeights(sd, parts)
    computed = {k for k in quantiser.scales if k not in sd} if quantiser else set()  # made from the weights, not read
    missing = [name for k in expected if k not in sd and k not in computed for name in missing_parts(k, stored, parts)]
    part_names = {name for pieces in parts.values() for name, _ in pieces}
    unexpected = [k for k in sd if k not in expected and k not in part_names]
    wanted = [pair for k, t in expected.items() if k in sd for pair in stored_shapes(k, tuple(t.shape), stored, parts)]
    wrong = [f"{name} {shape_of(stored, name)} vs {shape}" for name, shape in wanted if shape_of(stored, name) != shape]
    problems = []
    if missing:
        problems.append(f"missing {sample_keys(missing)} (an incomplete file, or a different model size)")
    if unexpected:
        stray = detect_family({k: sd[k] for k in unexpected})
        suggests = f": these look like {FAMILY_WHAT[stray]}, {LOAD_AS[FAMILY_KIND[stray]]}" if stray else ""
        problems.append(f"unexpected {sample_keys(unexpected)}{suggests}")
    if wrong:
        problems.append(f"wrong shapes {sample_keys(wrong, 2)} (checkpoint vs model: the config saved with "
                        "the weights does not match them)")
    if problems:
        raise FastARError(f"{source} does not fit the model it describes: " + "; ".join(problems))
    if not isinstance(stored, ShardedWeights):
        model.load_state_dict(recorded(loading_state(quantiser, ((k, sd[k]) for k in expected if k not in computed))),
                              strict=True, assign=True)
        return
    kept = quantiser.scales if quantiser else set()  # 8-bit scales stay fp32 (a pre-quantised file's, read here)
    for name in expected:
        if name in computed:
            continue
        tensor = sd[name]
        cast = dtype is not None and tensor.is_floating_point() and not is_codes(tensor) and name not in kept
        tensor = tensor.to(device=device, dtype=dtype if cast else None)
        model.load_state_dict(recorded(loading_state(quantiser, [(name, tensor)])), strict=False, assign=True)


_recording: contextvars.ContextVar[dict | None] = contextvars.ContextVar("fastar_recorded_weights", default=None)


@contextlib.contextmanager
def recording_weights():
    """Yields a dict that receives every tensor ``load_weights`` puts into a model inside, under the model's keys,
    as it goes in (before any later change the loader makes): what commands/quantize.py writes."""
    state: dict[str, torch.Tensor] = {}
    token = _recording.set(state)
    try:
        yield state
    finally:
        _recording.reset(token)


def recorded(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    record = _recording.get()
    if record is not None:
        record.update(state)
    return state
