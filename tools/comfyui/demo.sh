#!/usr/bin/env bash
# One command: install the real ComfyUI with the FastAR pack (tools/comfyui/setup.sh, idempotent), start it
# with the bundled demo models, run the demo workflow once, write out/comfyui_demo/demo_*.png and stats.json,
# and print the URL. Options go to tools/comfyui/demo.py: --keep-running, --port N, --out DIR.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
FASTAR_SKIP_BROWSER="${FASTAR_SKIP_BROWSER:-1}" bash "$root/tools/comfyui/setup.sh"
home="${FASTAR_COMFYUI_HOME:-$root/.comfyui}"
exec "$home/venv/bin/python" "$root/tools/comfyui/demo.py" "$@"
