#!/usr/bin/env bash
# sglang job: sglang 0.5.23's own scheduler loop (Scheduler, ScheduleBatch, radix cache, allocators, its Llama on
# torch-native attention) in process on the CPU with the canary installed, plus its pools driven by hand.
#
# Creates .venv-sglang from scratch (unless KEEP_VENV=1 and it already exists), then runs tests/engines/sglang.
# sglang pins torch 2.14.1 (CUDA) and ~140 requirements, so it is installed with --no-deps on top of the CPU
# torch 2.13.0 that lies on local disk, plus only the light packages its memory/attention modules import.
set -euo pipefail
cd "$(dirname "$0")/.."
ENGINE=sglang VENV=${SGLANG_VENV:-.venv-sglang}
source scripts/engine_venv.sh

if needs_venv; then
  new_venv
  say "sglang 0.5.23 (--no-deps: its metadata pins CUDA torch 2.14.1, flashinfer, sglang-kernel)"
  "${PIP[@]}" --no-deps sglang==0.5.23
  # The light packages that sglang.srt.mem_cache.*, model_executor.forward_batch_info and
  # layers.attention.torch_native_backend import at module level (found by importing them in a bare venv).
  say "light dependencies of sglang's memory and attention modules"
  # torch==2.13.0 is repeated so that no package's requirement can move it; triton because sglang.srt.utils
  # imports it at module level (3.9 runs on the CPU torch).
  "${PIP[@]}" torch==2.13.0 triton numpy orjson pybase64 requests pillow starlette msgspec pyzmq IPython aiohttp \
    dill apache-tvm-ffi==0.1.11 sentencepiece compressed-tensors gguf einops openai==2.8.0 partial_json_parser \
    transformers==5.24.0 psutil
  # The in-process Scheduler (tests/engines/sglang/test_scheduler_loop.py, the sglang self-test) imports these
  # on its way in (disaggregation receivers, process title, grammar backend).
  say "dependencies of sglang's scheduler module"
  "${PIP[@]}" torch==2.13.0 uvicorn fastapi setproctitle xgrammar
  # torchvision: sglang.srt.configs imports it (VLM processors) on the way to the memory pools. PyPI's
  # torchvision pulls a CUDA torch 2.14.1 (several GB), and its wheels fail to import beside the CPU 2.13
  # build ("operator torchvision::nms does not exist"). Nothing we run uses it, so a tiny import-only stub
  # stands in: any attribute is a placeholder class that refuses to be instantiated.
  say "torchvision import stub"
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  mkdir -p "$site/torchvision"
  cat > "$site/torchvision/__init__.py" <<'PY'
"""Import-only stand-in for torchvision, created by kvcanary's scripts/ci-sglang.sh (see there)."""
import enum
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.28.0"  # parsed by transformers' version checks


class InterpolationMode(enum.Enum):  # transformers builds a table of these at import time
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class _Unavailable:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("torchvision is an import-only stub in this environment")


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    if name == "InterpolationMode":
        return InterpolationMode
    return type(name, (_Unavailable,), {})


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = __getattr__
        return module

    def exec_module(self, module):
        pass


sys.meta_path.append(_Submodules())
PY
  say "kvcanary (editable, no deps) and test tools"
  "${PIP[@]}" --no-deps -e .
  "${PIP[@]}" torch==2.13.0 pytest
fi
say "installed: $("$VENV/bin/python" -c 'import torch, importlib.metadata as m; print("torch", torch.__version__, "sglang", m.version("sglang"))')"
# SETUP_ONLY=1: build the venv and stop (.ci/run builds it while the main suite runs).
if [ "${SETUP_ONLY:-0}" = 1 ]; then say "set up only"; exit 0; fi
say "pytest tests/engines/sglang"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/engines/sglang "$@"
# The self-test's detection matrix on sglang's own scheduler loop: every fault in N randomized trials plus
# clean controls; exit status 0 only when every fault is caught within one step and no control reports.
say "kvcanary selftest --engine sglang --trials ${SGLANG_SELFTEST_TRIALS:-5}"
"$VENV/bin/python" -m kvcanary selftest --engine sglang --trials "${SGLANG_SELFTEST_TRIALS:-5}"
# The soak: continuous randomized traffic on sglang's scheduler (prefix hits, chunked prefill, retractions, aborts)
# until the canary ran N steps; exit status 0 only when silent and steady (docs/soak.md). 12,000 steps: ~2-3 min.
say "kvcanary soak --engine sglang --steps ${SGLANG_SOAK_STEPS:-12000}"
"$VENV/bin/python" -m kvcanary soak --engine sglang --steps "${SGLANG_SOAK_STEPS:-12000}"
say "done"
