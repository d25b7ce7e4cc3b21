"""The ComfyUI test tier: one real ComfyUI server per test session (installed by tools/comfyui/setup.sh,
started on a free port by tools/comfyui/harness.py, stopped by its PID), with FastAR linked in as a
custom node and the stand-in checkpoints in a ``fastar:`` folder declared in extra_model_paths.yaml.

Everything here skips, with the reason, when the ComfyUI environment is not installed.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "comfyui"))

import harness  # noqa: E402
import standins  # noqa: E402

from fastar.model_loaders.demo import DEMO_AR, DEMO_VQ  # noqa: E402

WORKFLOWS = sorted((ROOT / "workflows").glob("*.json"))
REAL_DEMO = DEMO_AR.exists() and DEMO_VQ.exists()


def pytest_collection_modifyitems(config, items):
    problem = harness.installed()
    if problem is None:
        return
    skip = pytest.mark.skip(reason=f"ComfyUI tier: {problem}")
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).parent == here:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> Path:
    """Stand-in checkpoints; demo stand-ins only while the bundled demo weights do not exist."""
    folder = tmp_path_factory.mktemp("fastar_models")
    standins.write_all(folder, demo=not REAL_DEMO)
    return folder


@pytest.fixture(scope="session")
def comfy(tmp_path_factory, models):
    base = tmp_path_factory.mktemp("comfyui_base")
    server = harness.Server(base, model_folders=[models], extra_args=["--preview-method", "auto"])
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def object_info(comfy) -> dict:
    return comfy.object_info()


@pytest.fixture
def events(comfy):
    listener = harness.Events(comfy)
    yield listener
    listener.close()


def workflow_prompt(name: str, object_info: dict) -> dict:
    return harness.ui_to_api(harness.load_workflow(ROOT / "workflows" / f"{name}.json"), object_info)


def node_of(prompt: dict, class_type: str) -> dict:
    return next(n for n in prompt.values() if n["class_type"] == class_type)
