#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv with pinned packages.
# CPU torch comes from the registry's CPU wheel; the lock file stops pip from pulling CUDA builds.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check -c .ci/lock.txt)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  "${pip[@]}" "torch==2.13.0"
fi
"${pip[@]}" -r .ci/requirements-dev.txt
"${pip[@]}" --no-deps -e .
echo "environment ready: $root/.venv"
