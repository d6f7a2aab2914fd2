#!/usr/bin/env bash
# The test suite on the compiled build: setup.py's KVCANARY_COMPILE=1 modules compiled with mypyc in a copy of the
# tree, then ./scripts/test.sh's pytest against that copy (arguments go to pytest).  Tests that swap a compiled
# module's internals skip there, saying so (tests/compiled_build.py); the pure-Python build runs them.
KVCANARY_EXTRAS=test source "$(dirname "$0")/env.sh"
if ! command -v "${CC:-cc}" >/dev/null; then
  echo "[test-compiled] SKIPPED: no C compiler (${CC:-cc}) on this machine; the compiled build is not tested here" >&2
  exit 0
fi
root=$PWD
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
cp -r src setup.py pyproject.toml "$build"/
find "$build/src" \( -name '*.so' -o -name __pycache__ \) -prune -exec rm -rf {} +
echo "[test-compiled] compiling the per-step modules (mypyc)" >&2
start=$(date +%s)
(cd "$build" && KVCANARY_COMPILE=1 python setup.py -q build_ext --inplace >build.log 2>&1) || { cat "$build/build.log"; exit 1; }
echo "[test-compiled] $(find "$build/src" -name '*.so' | wc -l) extensions in $(( $(date +%s) - start ))s" >&2
export PYTHONPATH="$build/src:$root/tests"
python - <<'PY'
import kvcanary.adapters.transformers_cb.step_tap as m
assert not m.__file__.endswith(".py"), f"the compiled build was not picked up: {m.__file__}"
PY
echo "[test-compiled] pytest" >&2
pytest -q -p no:cacheprovider "$@"
