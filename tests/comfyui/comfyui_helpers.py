"""Shared by the ComfyUI tier's tests: paths, the example workflows in API format."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "comfyui"))

import harness  # noqa: E402

from fastar.model_loaders.shared.demo import DEMO_AR, DEMO_VQ  # noqa: E402

WORKFLOWS = sorted((ROOT / "workflows").glob("*.json"))
REAL_DEMO = DEMO_AR.exists() and DEMO_VQ.exists()


def workflow_prompt(name: str, object_info: dict) -> dict:
    return harness.ui_to_api(harness.load_workflow(ROOT / "workflows" / f"{name}.json"), object_info)


def node_of(prompt: dict, class_type: str) -> dict:
    return next(n for n in prompt.values() if n["class_type"] == class_type)
