#!/usr/bin/env bash
# The per-step modules compiled with mypyc, in place (setup.py's COMPILED; run from the repository root on the
# device, not by CI).  When .whl/compiled-<the device Python's tag> holds the extensions of this call's COMMIT
# (made beforehand by scripts/gpu/prebuild_compiled.sh), they are copied in and nothing is compiled here.
# Otherwise the build runs here: the device image has no mypy and no network, so mypy's wheels for the image's
# Python travel in .whl/mypy, fetched here once:
#   python3 -m pip download -d .whl/mypy --only-binary=:all: --python-version 3.12 \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 mypy==2.4.1
# mypy is installed to a directory of its own for the build only: the compiled modules need none of it to run.
# PREBUILT_ONLY=1: copy the prebuilt extensions or exit 2, never compile (demo_gpu.sh).
set -euo pipefail
start=$(date +%s)
prebuilt=.whl/compiled-$(python3 -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
if [ -f "$prebuilt/COMMIT" ] && [ "$(cat "$prebuilt/COMMIT")" = "${COMMIT:-}" ]; then
  cp -r "$prebuilt/src/." src/
  echo "[compile] prebuilt extensions of $COMMIT from $prebuilt"
elif [ "${PREBUILT_ONLY:-0}" = 1 ]; then
  echo "[compile] no extensions of COMMIT=${COMMIT:-?} in $prebuilt" >&2
  exit 2
else
  [ -d "$prebuilt" ] && echo "[compile] $prebuilt is of $(cat "$prebuilt/COMMIT" 2>/dev/null), not of ${COMMIT:-?}: compiling"
  python3 -m pip install -q --no-index --no-compile --no-cache-dir --find-links .whl/mypy --target /tmp/mypy-site mypy
  PYTHONPATH=/tmp/mypy-site KVCANARY_COMPILE=1 python3 setup.py -q build_ext --inplace -j "$(nproc)"
fi
echo "[compile] $(find src -name '*.so' | wc -l) extensions in $(( $(date +%s) - start ))s"
python3 -c 'import kvcanary.adapters.transformers_cb.step_tap as m; print("[compile] step_tap from", m.__file__)'
