#!/usr/bin/env bash
# sglang job: real sglang 0.5.23 memory pools, allocators, radix cache and torch-native attention on the CPU.
#
# Creates .venv-sglang from scratch (unless KEEP_VENV=1 and it already exists), then runs tests/engines/sglang.
# sglang pins torch 2.14.1 (CUDA) and ~140 requirements, so it is installed with --no-deps on top of the CPU
# torch 2.13.0 that lies on local disk, plus only the light packages its memory/attention modules import.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
VENV=.venv-sglang
start=$(date +%s)
say() { echo "[ci-sglang +$(( $(date +%s) - start ))s] $*" >&2; }

if [ "${KEEP_VENV:-0}" != 1 ] || [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  PIP=("$VENV/bin/pip" install -q --disable-pip-version-check)
  # torch FIRST and pinned: 2.13.0 is the CPU wheel on local disk. Anything later that merely asks for
  # "torch" is then satisfied; an unpinned resolve would pull a multi-GB CUDA build instead.
  say "torch 2.13.0 (CPU)"
  "${PIP[@]}" torch==2.13.0
  say "sglang 0.5.23 (--no-deps: its metadata pins CUDA torch 2.14.1, flashinfer, sglang-kernel)"
  "${PIP[@]}" --no-deps sglang==0.5.23
  # The light packages that sglang.srt.mem_cache.*, model_executor.forward_batch_info and
  # layers.attention.torch_native_backend import at module level (measured in shared/research/engines.md §3).
  say "light dependencies of sglang's memory and attention modules"
  "${PIP[@]}" torch==2.13.0 numpy orjson pybase64 requests pillow starlette msgspec pyzmq IPython aiohttp dill \
    apache-tvm-ffi==0.1.11 sentencepiece compressed-tensors gguf einops openai==2.8.0 partial_json_parser \
    transformers==5.24.0 psutil
  say "kvcanary (editable, no deps) and test tools"
  "${PIP[@]}" --no-deps -e .
  "${PIP[@]}" torch==2.13.0 pytest
fi
say "installed: $("$VENV/bin/python" -c 'import torch, importlib.metadata as m; print("torch", torch.__version__, "sglang", m.version("sglang"))')"
say "pytest tests/engines/sglang"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/engines/sglang "$@"
say "done"
