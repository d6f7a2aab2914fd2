# Sourced by the other scripts: make .venv with everything the project needs, once.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/kvcanary ] || [ pyproject.toml -nt .venv/.stamp ]; then
  echo "[setup] creating .venv and installing kvcanary with its test extras" >&2
  "$PY" -m venv .venv
  # torch first and pinned: 2.13.0 is the CPU build on local disk; an unpinned resolve would pull CUDA torch.
  .venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
  .venv/bin/pip install -q --disable-pip-version-check -e '.[test]'
  touch .venv/.stamp
fi
export PATH="$PWD/.venv/bin:$PATH"
