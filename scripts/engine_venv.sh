# Sourced by ci-sglang.sh and ci-vllm.sh (after `cd` to the repo root): the interpreter, a timed logger and
# the start of an engine's own venv.  Usage: ENGINE=<name> VENV=<dir> source scripts/engine_venv.sh, then
#   if needs_venv; then new_venv; ...engine-specific installs with "${PIP[@]}"...; fi
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
start=$(date +%s)
say() { echo "[ci-$ENGINE +$(( $(date +%s) - start ))s] $*" >&2; }
# KEEP_VENV=1 reuses an existing venv (.ci/run builds it first with SETUP_ONLY=1).
needs_venv() { [ "${KEEP_VENV:-0}" != 1 ] || [ ! -x "$VENV/bin/python" ]; }
new_venv() {
  say "creating $VENV"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  PIP=("$VENV/bin/pip" install -q --disable-pip-version-check)
  # torch FIRST and pinned: 2.13.0 is the CPU wheel (local disk here, PyTorch's CPU index elsewhere). Anything
  # later that merely asks for "torch" is then satisfied; an unpinned resolve would pull a multi-GB CUDA build.
  say "torch 2.13.0 (CPU)"
  "${PIP[@]}" torch==2.13.0
}
