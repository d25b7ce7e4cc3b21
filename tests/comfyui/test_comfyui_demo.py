"""The README's one-command demo (tools/comfyui/demo.py): starts ComfyUI with the pack, runs the demo
workflow, writes the images and the stats, and prints the URL."""
import json
import os
import subprocess

from comfyui_helpers import REAL_DEMO, ROOT
from PIL import Image

import harness


def test_demo_command_writes_images_and_stats(comfy_env, models, tmp_path):
    command = [str(harness.python()), str(ROOT / "tools" / "comfyui" / "demo.py"), "--out", str(tmp_path),
               "--port", str(harness.free_port())]
    if not REAL_DEMO:
        command += ["--models", str(models)]  # stand-ins while the bundled demo weights are being trained
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ})
    assert result.returncode == 0, result.stderr[-3000:]
    images = sorted(tmp_path.glob("demo_*.png"))
    assert len(images) == 4 and Image.open(images[0]).size == (128, 128)
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["decoder"] == "sjd" and stats["tokens"] == [256] * 4 and stats["target_forwards"] < 255
    assert "http://127.0.0.1:" in result.stderr and "--keep-running" in result.stderr
