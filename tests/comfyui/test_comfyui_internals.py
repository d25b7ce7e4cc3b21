"""The node layer's ComfyUI glue, checked inside ComfyUI's own Python (tests/comfyui/in_comfy_checks.py),
and the package staying importable without ComfyUI."""
import os
import subprocess
import sys

from comfyui_helpers import ROOT

import harness


def test_glue_inside_comfyui_python(comfy_env):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    result = subprocess.run([str(harness.python()), str(ROOT / "tests" / "comfyui" / "in_comfy_checks.py"),
                             str(harness.comfyui_dir()), str(ROOT)], capture_output=True, text=True, timeout=600,
                            env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "all in-ComfyUI checks passed" in result.stdout


def test_package_imports_without_comfyui_and_without_torch():
    code = ("import sys, fastar; assert 'torch' not in sys.modules, 'torch imported eagerly'; "
            "assert not hasattr(fastar, 'NODE_CLASS_MAPPINGS'); print(fastar.WEB_DIRECTORY)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT.parent)
    assert result.returncode == 0, result.stderr
    result = subprocess.run([sys.executable, "-m", "fastar", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "generate" in result.stdout
