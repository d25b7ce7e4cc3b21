#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv with pinned packages.
# CPU torch comes from the registry's CPU wheel; the lock file stops pip from pulling CUDA builds.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
source tools/setup_lib.sh
if [ ! -x .venv/bin/python ]; then
  "$(pick_python)" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  pip_quiet .venv/bin/python "torch==2.13.0"
fi
pip_quiet .venv/bin/python -r .ci/requirements-dev.txt
pip_quiet .venv/bin/python --no-deps -e .
echo "environment ready: $root/.venv"
