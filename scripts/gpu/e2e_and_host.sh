#!/usr/bin/env bash
# One device call for issues 14 and 18 (not run by CI): bench_e2e (issue 18), the Qwen3-0.6B generate_batch
# workload (issue 14 part 1; with OLD_SRC=<dir> also run against another source tree, to compare), the GPU
# demo's host time per step (issue 14 part 2) and a profile of the tap.  Each stage has its own time limit
# and writes under $OUT as it goes, so a cut-short call keeps what finished.  Needs the transformers 5.24.0
# wheel in .whl (see demo_gpu.sh) and COMMIT=<sha> for the result files.
set -uo pipefail
OUT=${OUT:-/tmp/kvcanary-e2e-host}
mkdir -p "$OUT"
if compgen -G ".whl/transformers-5.24.0-*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/transformers-5.24.0-*.whl || exit 3
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
BASE_PATH=${PYTHONPATH:-}
export PYTHONPATH=$PWD/src${BASE_PATH:+:$BASE_PATH}
export PYTHONUNBUFFERED=1
COMMIT=${COMMIT:-unknown}
T_E2E=${T_E2E:-170} T_CB=${T_CB:-150} T_DEMO=${T_DEMO:-60} T_PROF=${T_PROF:-45} T_OLD=${T_OLD:-90}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)'
} 2>&1 | tee "$OUT/run.log"
stage() { echo "=== $1 ($(date -u +%T))" | tee -a "$OUT/run.log" >&2; }

stage e2e
timeout "$T_E2E" python3 benchmarks/bench_e2e.py --commit "$COMMIT" --out "$OUT" ${E2E_POINTS:+--points $E2E_POINTS} \
  >>"$OUT/run.log" 2>&1
stage cb_qwen3
timeout "$T_CB" python3 scripts/gpu/cb_qwen3_workload.py --out "$OUT" >>"$OUT/run.log" 2>&1
stage demo
for model in dense hybrid sliding; do
  timeout "$T_DEMO" python3 -m kvcanary.cli demo --model "$model" --device cuda --baseline --quiet >>"$OUT/demo.txt" 2>&1
done
stage profile
timeout "$T_PROF" python3 scripts/gpu/host_profile.py --model dense >"$OUT/profile.txt" 2>&1
if [ -n "${OLD_SRC:-}" ]; then
  stage "cb_qwen3 on $OLD_SRC"
  PYTHONPATH=$PWD/$OLD_SRC${BASE_PATH:+:$BASE_PATH} timeout "$T_OLD" python3 scripts/gpu/cb_qwen3_workload.py \
    --out "$OUT" --name cb_qwen3_old --runs b32_graphs,b1_graphs,b32_eager >>"$OUT/run.log" 2>&1
fi
stage done
