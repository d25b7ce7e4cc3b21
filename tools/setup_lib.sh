# Sourced by tools/setup_env.sh and tools/comfyui/setup.sh: the Python to build environments with, and pip
# without the machine's noise.

# PYTHON if set, else python3.11 (the CPU torch wheel pinned in .ci/lock.txt is for 3.11), else python3.
pick_python() {
  local chosen="${PYTHON:-}"
  if [ -z "$chosen" ]; then
    if command -v python3.11 >/dev/null; then chosen=python3.11; else chosen=python3; fi
  fi
  local version
  version="$("$chosen" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  if [ "$version" != "3.11" ]; then
    echo "note: $chosen is Python $version; the pinned CPU torch (torch==2.13.0) is a Python 3.11 wheel, so pip" \
      "may download a large CUDA build instead. Set PYTHON=python3.11 to use 3.11." >&2
  fi
  echo "$chosen"
}

# pip install with the lock as constraints, its output filtered of the warnings about index locations that do
# not exist on this machine; pip's exit status is kept.
pip_quiet() {
  local python="$1" log status=0
  shift
  log="$(mktemp)"
  "$python" -m pip install --quiet --disable-pip-version-check -c .ci/lock.txt "$@" >"$log" 2>&1 || status=$?
  grep -v "is ignored: it is neither a file nor a directory" "$log" || true
  rm -f "$log"
  return "$status"
}
