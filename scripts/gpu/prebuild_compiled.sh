#!/usr/bin/env bash
# The compiled build (setup.py's COMPILED) made here for the device's Python, so that a device call spends none of
# its time in mypyc (on an H100 machine the build ran past 200 s; here it takes about four minutes of CPU).
# The extensions of HEAD's source land in .whl/compiled-<tag>/ (carried with .whl) with the commit they are of;
# scripts/gpu/build_compiled.sh installs them into the device's tree when that commit is the call's COMMIT.
#   scripts/gpu/prebuild_compiled.sh [python of the device's version, default pyenv's 3.12]
# mypy reads torch's types from this checkout's .venv (the CPU build), through --python-executable.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${1:-/root/.pyenv/versions/3.12.1/bin/python3.12}
TAG=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
VER=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
BUILD_ENV=/tmp/kvcanary-prebuild-$TAG
[ -x "$BUILD_ENV/bin/python" ] || { "$PY" -m venv "$BUILD_ENV" && "$BUILD_ENV/bin/pip" install -q mypy==2.4.1 setuptools; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git archive HEAD | tar -x -C "$work"
start=$(date +%s)
flags="--python-executable $PWD/.venv/bin/python --python-version $VER"
(cd "$work" && KVCANARY_COMPILE=1 KVCANARY_MYPY_FLAGS="$flags" \
  "$BUILD_ENV/bin/python" setup.py -q build_ext --inplace -j "$(nproc)" >"$work/build.log" 2>&1) \
  || { tail -20 "$work/build.log"; exit 1; }
dest=.whl/compiled-$TAG
rm -rf "$dest" && mkdir -p "$dest"
(cd "$work" && find src -name '*.so' -print0 | tar --null -cf - -T -) | tar -xf - -C "$dest"
git rev-parse HEAD >"$dest/COMMIT"
echo "[prebuild] $(find "$dest" -name '*.so' | wc -l) extensions for $TAG of $(cat "$dest/COMMIT") in $(( $(date +%s) - start ))s"
