"""Start and drive the real ComfyUI that tools/comfyui/setup.sh installed: a server on a free port with
the FastAR pack, stopped by its PID; the HTTP API (/object_info, /prompt, /history, /view, /interrupt);
and the conversion of UI-format workflows (what the web UI saves, and what workflows/ holds) to the API
format that /prompt takes. Standard library only: it runs under any Python.
"""
from __future__ import annotations

import base64
import ctypes
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOME = Path(os.environ.get("FASTAR_COMFYUI_HOME", ROOT / ".comfyui"))
PACK_NAME = "FastAR"
PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h)
FRONTEND_ONLY = {"Note", "MarkdownNote", "Reroute", "PrimitiveNode"}  # nodes that never reach the server


def python() -> Path:
    return HOME / "venv" / "bin" / "python"


def comfyui_dir() -> Path:
    return HOME / "ComfyUI"


def installed() -> str | None:
    """None when the ComfyUI environment is ready, else what is missing."""
    if not python().exists():
        return f"no ComfyUI virtual environment at {python()}: run bash tools/comfyui/setup.sh"
    if not (comfyui_dir() / "main.py").exists():
        return f"no ComfyUI at {comfyui_dir()}: run bash tools/comfyui/setup.sh"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_base(base: Path, model_folders: list[Path] | None = None, drafter_folders: list[Path] | None = None) -> Path:
    """A ComfyUI base directory with the pack linked into custom_nodes, and an extra_model_paths.yaml
    that declares ``fastar:`` and ``fastar_drafters:`` folders (as users do); returns the yaml path."""
    (base / "custom_nodes").mkdir(parents=True, exist_ok=True)
    link = base / "custom_nodes" / PACK_NAME
    if link.is_symlink() and link.resolve() != ROOT:
        link.unlink()
    if not link.exists():
        link.symlink_to(ROOT, target_is_directory=True)
    for sub in ("models", "input", "output", "temp", "user"):
        (base / sub).mkdir(exist_ok=True)
    lines = ["fastar_test:", f"  base_path: {base}"]
    for name, folders in (("fastar", model_folders), ("fastar_drafters", drafter_folders)):
        if folders:
            lines.append(f"  {name}: |")
            lines += [f"    {folder}" for folder in folders]
    yaml = base / "extra_model_paths.yaml"
    yaml.write_text("\n".join(lines) + "\n")
    return yaml


def die_with_parent() -> None:
    """In the server's process before it starts ComfyUI: Linux sends it SIGTERM when the process that
    started it dies, even by SIGKILL, so no server outlives its script on its port."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the script's own signal handling is all there is
        pass


@dataclass
class Server:
    """One ComfyUI process. ``with Server(base) as s: ...`` starts it and stops it by PID."""

    base: Path
    model_folders: list[Path] = field(default_factory=list)
    drafter_folders: list[Path] = field(default_factory=list)
    port: int = 0
    extra_args: list[str] = field(default_factory=list)
    settings: dict = field(default_factory=dict)  # the default user's UI settings (comfy.settings.json)
    log_path: Path | None = None
    process: subprocess.Popen | None = None
    client_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180.0) -> "Server":
        problem = installed()
        if problem:
            raise RuntimeError(problem)
        self.port = self.port or free_port()
        yaml = write_base(self.base, self.model_folders, self.drafter_folders)
        if self.settings:
            user = self.base / "user" / "default"
            user.mkdir(parents=True, exist_ok=True)
            (user / "comfy.settings.json").write_text(json.dumps(self.settings))
        self.log_path = self.log_path or self.base / "comfyui.log"
        command = [str(python()), "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(self.port),
                   "--disable-auto-launch", "--dont-print-server", "--base-directory", str(self.base),
                   "--database-url", "sqlite:///:memory:", "--extra-model-paths-config", str(yaml),
                   *self.extra_args]
        # one CPU thread unless told otherwise: with the cores shared (CI, a training job), PyTorch's
        # spinning OpenMP threads make a small model's forwards a hundred times slower
        env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"}
        env.pop("PYTHONPATH", None)
        log = open(self.log_path, "w")
        self.process = subprocess.Popen(command, cwd=comfyui_dir(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True, preexec_fn=die_with_parent)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {self.process.returncode}:\n{self.log()[-3000:]}")
            try:
                argv = self.get("/system_stats", timeout=2)["system"]["argv"]
            except (OSError, urllib.error.URLError):
                time.sleep(0.5)
                continue
            if str(self.base) not in argv:  # another server (another test process's) took the port first
                self.stop()
                raise RuntimeError(f"port {self.port} answers for another ComfyUI ({' '.join(argv)}): start again")
            return self
        self.stop()
        raise RuntimeError(f"ComfyUI did not answer within {timeout:.0f} s:\n{self.log()[-3000:]}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)  # the session started for this server only
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=15)

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    # -- HTTP ----------------------------------------------------------------------------------------

    def request(self, path: str, data: dict | None = None, timeout: float = 30.0):
        body = json.dumps(data).encode() if data is not None else None
        req = urllib.request.Request(self.url + path, data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as response:
            raw = response.read()
        return json.loads(raw) if raw.strip() else None

    def get(self, path: str, timeout: float = 30.0):
        return self.request(path, timeout=timeout)

    def object_info(self) -> dict:
        return self.get("/object_info", timeout=120)

    def queue(self, prompt: dict) -> dict:
        """POST /prompt; returns the answer (``prompt_id``, ``node_errors``) or, for a rejected prompt,
        the error body (``error``, ``node_errors``)."""
        try:
            return self.request("/prompt", {"prompt": prompt, "client_id": self.client_id})
        except urllib.error.HTTPError as e:
            return json.loads(e.read() or b"{}")

    def wait(self, prompt_id: str, timeout: float = 300.0) -> dict:
        """The /history entry of a finished prompt."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            history = self.get(f"/history/{prompt_id}")
            if history and prompt_id in history and history[prompt_id].get("status", {}).get("completed") is not None:
                entry = history[prompt_id]
                if entry["status"].get("status_str") in ("success", "error") or entry["status"]["completed"]:
                    return entry
            time.sleep(0.25)
        raise TimeoutError(f"prompt {prompt_id} did not finish within {timeout:.0f} s")

    def run(self, prompt: dict, timeout: float = 300.0) -> dict:
        answer = self.queue(prompt)
        if "prompt_id" not in answer or answer.get("node_errors"):
            raise RuntimeError(f"ComfyUI rejected the prompt: {json.dumps(answer)[:3000]}")
        return self.wait(answer["prompt_id"], timeout)

    def free_memory(self) -> None:
        """Drop ComfyUI's output cache and unload its models before the next prompt runs. ComfyUI acts on /free
        between two prompts, after the next one a busy worker picks up, so a prompt queued at once could still
        find its outputs cached: an image-only prompt takes that turn."""
        self.request("/free", {"free_memory": True})
        self.run({"1": {"class_type": "EmptyImage", "inputs": {"width": 8, "height": 8, "batch_size": 1, "color": 0}},
                  "2": {"class_type": "PreviewImage", "inputs": {"images": ["1", 0]}}})

    def interrupt(self) -> None:
        self.request("/interrupt", {})

    def fetch(self, image: dict) -> bytes:
        query = urllib.parse.urlencode({k: image[k] for k in ("filename", "subfolder", "type")})
        with urllib.request.urlopen(f"{self.url}/view?{query}", timeout=30) as response:
            return response.read()


def status_messages(entry: dict) -> list:
    return entry.get("status", {}).get("messages", [])


def execution_error(entry: dict) -> dict | None:
    for kind, data in status_messages(entry):
        if kind == "execution_error":
            return data
    return None


def output_images(entry: dict) -> list[dict]:
    return [image for output in entry.get("outputs", {}).values() for image in output.get("images", [])]


class Events:
    """The server's websocket messages to this client (a minimal RFC 6455 client, text and binary
    frames): ``messages`` holds ``(time, kind, data)``; binary preview images count as kind "preview"."""

    def __init__(self, server: Server):
        self.messages: list[tuple[float, str, object]] = []
        self.sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET /ws?clientId={server.client_id} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
                           f"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                           "Sec-WebSocket-Version: 13\r\n\r\n").encode())
        header = b""
        while b"\r\n\r\n" not in header:
            header += self.sock.recv(1)
        if b" 101 " not in header.split(b"\r\n")[0]:
            raise ConnectionError(f"websocket refused: {header[:200]!r}")
        self.sock.settimeout(None)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _exact(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("closed")
            data += chunk
        return data

    def _read(self) -> None:
        try:
            while True:
                first, second = self._exact(2)
                length = second & 0x7F
                if length == 126:
                    length = struct.unpack(">H", self._exact(2))[0]
                elif length == 127:
                    length = struct.unpack(">Q", self._exact(8))[0]
                payload = self._exact(length)
                opcode = first & 0x0F
                now = time.monotonic()
                if opcode == 1:
                    message = json.loads(payload)
                    self.messages.append((now, message.get("type"), message.get("data")))
                elif opcode == 2:
                    kind = struct.unpack(">I", payload[:4])[0]
                    self.messages.append((now, "preview" if kind in (1, 4) else f"binary{kind}", payload[8:]))
                elif opcode == 8:
                    return
        except (OSError, ConnectionError, ValueError):
            return

    def of(self, kind: str, prompt_id: str | None = None) -> list:
        def matches(data) -> bool:
            return prompt_id is None or not isinstance(data, dict) or data.get("prompt_id") in (None, prompt_id)

        return [(t, d) for t, k, d in list(self.messages) if k == kind and matches(d)]

    def wait_for(self, kind: str, prompt_id: str | None = None, timeout: float = 120.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.of(kind, prompt_id)
            if found:
                return found[0]
            time.sleep(0.02)
        raise TimeoutError(f"no {kind} message within {timeout:.0f} s")

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


# -- UI format -> API format ---------------------------------------------------------------------------


WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")


def node_inputs(info: dict) -> list[tuple[str, object, dict, bool]]:
    """``(name, type, options, is_widget)`` of each input of a node's /object_info entry, in the frontend's order;
    a widget type with ``forceInput`` is a socket."""
    order = info.get("input_order") or {s: list(info["input"].get(s, {})) for s in ("required", "optional")}
    inputs = []
    for section in ("required", "optional"):
        for name in order.get(section, []):
            spec = info["input"][section][name]
            options = spec[1] if len(spec) > 1 else {}
            is_widget = isinstance(spec[0], list) or spec[0] in WIDGET_TYPES
            inputs.append((name, spec[0], options, is_widget and not options.get("forceInput")))
    return inputs


def ui_to_api(workflow: dict, object_info: dict) -> dict:
    """The API-format prompt of a UI-format workflow, as the web UI builds it: widget values are matched
    to the node's widget inputs by position (a seed's control_after_generate value is skipped), links
    become ``[source id, output slot]``; frontend-only nodes and muted/bypassed nodes are dropped."""
    links = {link[0]: link for link in workflow.get("links", [])}
    prompt = {}
    for node in workflow["nodes"]:
        kind = node["type"]
        if kind in FRONTEND_ONLY or node.get("mode", 0) in (2, 4):
            continue
        if kind not in object_info:
            raise KeyError(f"node type {kind} (node {node['id']}) is not known to this ComfyUI")
        info = object_info[kind]
        inputs = {}
        values = list(node.get("widgets_values") or [])
        if isinstance(node.get("widgets_values"), dict):
            values = []
            inputs.update(node["widgets_values"])
        linked = {i["name"]: i.get("link") for i in node.get("inputs", []) if i.get("link") is not None}
        position = 0
        for name, _, options, is_widget in node_inputs(info):
            if is_widget:
                if position < len(values):
                    inputs[name] = values[position]
                position += 1
                if options.get("control_after_generate"):
                    position += 1
            if name in linked:
                link = links[linked[name]]
                inputs[name] = [str(link[1]), link[2]]
        prompt[str(node["id"])] = {"class_type": kind, "inputs": inputs, "_meta": {"title": node.get("title", kind)}}
    return prompt


def load_workflow(path: Path) -> dict:
    return json.loads(Path(path).read_text())


if __name__ == "__main__":  # a manual check: start, list FastAR nodes, stop
    with Server(HOME / "base-manual") as server:
        print(sorted(k for k in server.object_info() if k.startswith("FastAR")), file=sys.stderr)
