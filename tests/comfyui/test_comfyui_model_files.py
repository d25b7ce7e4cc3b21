"""Names a workflow gives the loaders, resolved in the model folders by nodes/files.py over a stand-in
folder_paths (no ComfyUI needed): a name that leaves the registered folders ("..", absolute, a drive) is refused
before anything is looked up, for folders and files alike, while links the user made inside the folders still
load, as ComfyUI's own lists show what lies behind them."""
import importlib.util
import os
import sys
import types
from pathlib import Path

import pytest
from comfyui_helpers import ROOT

from fastar.errors import FastARError


class FolderPaths(types.ModuleType):
    """ComfyUI's folder_paths as nodes/files.py uses it, with a get_full_path that joins the name as it comes:
    it does not map '../x' to 'x' as ComfyUI's does, so FastAR's refusal cannot lean on that."""

    def __init__(self, roots: dict[str, list[Path]]):
        super().__init__("folder_paths")
        self.roots, self.looked_up = roots, []

    def get_folder_paths(self, folder: str) -> list[str]:
        return [str(root) for root in self.roots[folder]]

    def get_full_path(self, folder: str, name: str) -> str | None:
        self.looked_up.append(name)
        return next((str(root / name) for root in self.roots.get(folder, []) if (root / name).is_file()), None)


@pytest.fixture
def layout(tmp_path) -> Path:
    """models/ (the fastar folder) holds a model file and a link to a collection on another disk (a model
    folder and a file in it) and a file link; outside/ holds what no workflow may reach."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "model.safetensors").write_bytes(b"")
    for folder in (tmp_path / "collection" / "big", tmp_path / "outside" / "secret", tmp_path / "encoders" / "flan"):
        folder.mkdir(parents=True)
    (tmp_path / "collection" / "big" / "model.safetensors").write_bytes(b"")
    (tmp_path / "collection" / "big.safetensors").write_bytes(b"")
    (tmp_path / "outside" / "secret" / "model.safetensors").write_bytes(b"")
    (tmp_path / "outside" / "secret.safetensors").write_bytes(b"")
    (tmp_path / "models" / "linked").symlink_to(tmp_path / "collection", target_is_directory=True)
    (tmp_path / "models" / "kept.safetensors").symlink_to(tmp_path / "collection" / "big.safetensors")
    return tmp_path


@pytest.fixture
def folder_paths(layout, monkeypatch) -> FolderPaths:
    standin = FolderPaths({"fastar": [layout / "models"], "fastar_drafters": [layout / "drafters"],
                           "text_encoders": [layout / "encoders"]})
    monkeypatch.setitem(sys.modules, "folder_paths", standin)
    return standin


@pytest.fixture
def files(folder_paths, monkeypatch):
    """nodes/files.py, loaded without the nodes package's __init__ (which imports ComfyUI's node API)."""
    package = types.ModuleType("fastar.nodes")
    package.__path__ = [str(ROOT / "nodes")]
    monkeypatch.setitem(sys.modules, "fastar.nodes", package)
    spec = importlib.util.spec_from_file_location("fastar.nodes.files", ROOT / "nodes" / "files.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LEAVING = [
    "../outside/secret/", "../outside/secret.safetensors",  # climbs out
    "linked/../outside/secret/", "linked/../outside/secret.safetensors",  # '..' after a link climbs from its target
    "..\\outside\\secret.safetensors", ".. /outside/secret/",  # Windows' separator; Windows drops the space
    "C:/outside/secret/", "\\\\server\\share\\secret.safetensors",  # a drive, a share
]


@pytest.mark.parametrize("name", LEAVING)
def test_a_name_that_leaves_the_model_folders_is_refused_before_a_look_up(files, folder_paths, name):
    with pytest.raises(FastARError) as refused:
        files.resolve(name, files.AR)
    assert str(refused.value) == (
        f"model_name '{name}' leaves ComfyUI's model folders, and FastAR reads models only from them: pick an entry "
        "of the list, or put it in ComfyUI's models/fastar folder (or a fastar: path in extra_model_paths.yaml) and "
        "press R to refresh the lists")
    assert folder_paths.looked_up == []


@pytest.mark.parametrize("entry", ["secret/", "secret.safetensors"])
def test_an_absolute_name_is_refused_even_for_a_model_that_exists(files, layout, entry):
    name = f"{layout / 'outside'}{os.sep}{entry}"
    with pytest.raises(FastARError, match="leaves ComfyUI's model folders"):
        files.resolve(name, files.AR)


@pytest.mark.parametrize("kind,name,message", [
    ("vq", "../outside/secret.safetensors", "vq_name '../outside/secret.safetensors' leaves ComfyUI's model folders"),
    ("drafter", "../outside/secret/", "or put it in ComfyUI's models/fastar_drafters folder (or a fastar_drafters:"),
    ("t5", "../outside/secret/", "t5_folder '../outside/secret/' leaves ComfyUI's model folders, and FastAR reads "
                                 "models only from them: pick an entry of the list, or put it in ComfyUI's "
                                 "models/fastar or models/text_encoders folder (or a fastar: or text_encoders: path"),
])
def test_the_refusal_names_the_input_and_where_its_models_go(files, kind, name, message):
    with pytest.raises(FastARError) as refused:
        files.resolve(name, kind)
    assert message in str(refused.value)


def test_links_the_user_made_inside_a_model_folder_still_load(files, layout):
    models = layout / "models"
    assert ("linked/big/", models / "linked" / "big") in files.model_folders(files.folder_roots(), files.AR)
    assert files.resolve("linked/big/", files.AR) == models / "linked" / "big"
    assert files.resolve("linked/big.safetensors", files.AR) == models / "linked" / "big.safetensors"
    assert files.resolve("kept.safetensors", files.AR).resolve() == layout / "collection" / "big.safetensors"
    assert files.resolve("model.safetensors", files.AR) == models / "model.safetensors"


def test_a_missing_flan_t5_folder_names_both_folders_it_is_looked_for_in(files, layout):
    assert files.resolve("flan/", files.T5) == layout / "encoders" / "flan"
    with pytest.raises(FastARError) as missing:
        files.resolve("flan-t5-xl/", files.T5)
    assert str(missing.value) == (
        "no FLAN-T5 folder named 'flan-t5-xl/' in the model folders: put it in ComfyUI's models/fastar or "
        "models/text_encoders folder (or a fastar: or text_encoders: path in extra_model_paths.yaml) and press R "
        "to refresh the lists")
