# Sourced by the other scripts: make .venv with what the calling script needs, once.
#   KVCANARY_EXTRAS=transformers  (demo.sh: the demo's engine only, about 1 GB less than the test extras)
#   KVCANARY_EXTRAS=test          (test.sh: the engine, triton, prometheus-client, pytest, ruff, mypy)
# The test extras include everything the demo needs, so either order of the two commands works.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
EXTRAS=${KVCANARY_EXTRAS:-test}
_setup_start=$(date +%s)
_say() { echo "[setup +$(( $(date +%s) - _setup_start ))s] $*" >&2; }
_ready() { [ -x .venv/bin/kvcanary ] && { [ -f ".venv/.stamp-$1" ] && [ ! pyproject.toml -nt ".venv/.stamp-$1" ]; }; }
if ! _ready "$EXTRAS" && ! { [ "$EXTRAS" = transformers ] && _ready test; }; then
  if [ ! -x .venv/bin/python ]; then
    _say "creating .venv"
    "$PY" -m venv .venv
  fi
  PIP=(.venv/bin/pip install --disable-pip-version-check --progress-bar off)
  # torch first and pinned: 2.13.0 is the CPU build on local disk; an unpinned resolve would pull CUDA torch.
  _say "installing torch 2.13.0 (CPU build)"
  "${PIP[@]}" -q torch==2.13.0
  _say "installing kvcanary with the '$EXTRAS' extras (one line per package)"
  "${PIP[@]}" -e ".[$EXTRAS]" 2>&1 | { grep --line-buffered -E '^(Collecting|Successfully installed)' || true; } | sed -u 's/^/  /' >&2
  touch ".venv/.stamp-$EXTRAS"
  _say "done"
fi
export PATH="$PWD/.venv/bin:$PATH"
