"""The ComfyUI test tier: one real ComfyUI server per test process (installed by tools/comfyui/setup.sh,
started on a free port by tools/comfyui/harness.py, stopped by its PID), with FastAR linked in as a
custom node, the stand-in checkpoints in a ``fastar:`` folder and the stand-in drafters in a
``fastar_drafters:`` folder, both declared in extra_model_paths.yaml.

Tests that need ComfyUI skip, with the reason, when its environment is not installed.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from comfyui_helpers import REAL_DEMO, harness

import standins


@pytest.fixture(scope="session")
def comfy_env() -> None:
    problem = harness.installed()
    if problem is not None:
        pytest.skip(f"ComfyUI tier: {problem}")


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> Path:
    """Stand-in checkpoints; demo stand-ins (model, VQ, drafter) only while the bundled ones do not exist."""
    folder = tmp_path_factory.mktemp("fastar_models")
    standins.write_all(folder, demo=not REAL_DEMO)
    return folder


@pytest.fixture(scope="session")
def drafters(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("fastar_drafters")
    standins.write_drafters(folder)
    return folder


@pytest.fixture(scope="session")
def comfy(comfy_env, tmp_path_factory, models, drafters):
    base = tmp_path_factory.mktemp("comfyui_base")
    server = harness.Server(base, model_folders=[models], drafter_folders=[drafters],
                            extra_args=["--preview-method", "auto"])
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

