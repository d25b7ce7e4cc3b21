"""The README's one-command demo (tools/comfyui/demo.py): starts ComfyUI with the pack, runs the demo
workflow, writes the images and the stats, and prints the URL."""
import json
import os
import signal
import socket
import subprocess
import time

import pytest
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
    assert stats["decoder"] == "sjd" and stats["tokens"] == 256 and stats["batch"] == 4 and stats["target_forwards"] < 255
    assert "http://127.0.0.1:" in result.stderr and "--keep-running" in result.stderr


def port_answers(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL])
def test_keep_running_demo_stopped_by_a_signal_leaves_no_server(comfy_env, models, tmp_path, stop):
    """ComfyUI runs in its own session, so a signal to the demo script does not reach it: SIGTERM stops it
    through the script, and even SIGKILL (no handler runs) takes it down, by the parent-death signal."""
    port = harness.free_port()
    command = [str(harness.python()), str(ROOT / "tools" / "comfyui" / "demo.py"), "--out", str(tmp_path),
               "--port", str(port), "--keep-running"]
    if not REAL_DEMO:
        command += ["--models", str(models)]
    demo = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env={**os.environ})
    try:
        for line in demo.stderr:
            if "Press Ctrl-C to stop ComfyUI" in line:
                break
        assert port_answers(port), "the demo did not keep ComfyUI running"
        demo.send_signal(stop)
        demo.wait(timeout=60)
        deadline = time.monotonic() + 30
        while port_answers(port) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not port_answers(port), f"ComfyUI still serves port {port} after the demo got {stop.name}"
    finally:
        demo.kill()
        demo.wait()
