#!/usr/bin/env bash
# `kvcanary demo` on the GPU: the CPU demo's workload (64 prompts x 2 sampled sequences, shared prefixes,
# forks, CPU offload) on the lent H200, with the canary's GPU path (Backend.AUTO -> Triton kernels), for
# the three model kinds, plus runs with the engine's asynchronous batching and its CUDA graphs (padded
# batches, warm-up forwards, graph replays the canary reads after).  The three main runs also time the
# same workload with the canary off (--baseline --rounds ROUNDS, default 5 here: alternating pairs of timed
# runs; three moved the share by tens of points between calls) and print the canary's share of step time (the
# median of the pairs').
#
# The compiled build (setup.py's KVCANARY_COMPILE) runs when .whl/compiled-<the device Python's tag> holds the
# extensions of COMMIT (made here by scripts/gpu/prebuild_compiled.sh): on two H100 machines its share's floor was
# 0.4-0.9 points lower on every model.  Otherwise, or with COMPILED=0, the pure-Python build runs.
#
# Not run by CI.  The transformers 5.24.0 wheel travels in .whl (scripts/gpu/transformers_wheel.sh says how);
#   device call: carry [".whl"], command: COMMIT=<sha> bash scripts/gpu/demo_gpu.sh
# Writes $OUT/demo_<model>.txt (summaries), $OUT/demo_dense_async.json and $OUT/demo_hybrid_graphs.json;
# exit 0 only if every run passed.
set -uo pipefail
OUT=${OUT:-/tmp/kvcanary-demo-gpu}
mkdir -p "$OUT"
source scripts/gpu/transformers_wheel.sh  # the transformers 5.24.0 wheel from .whl
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
built=2  # build_compiled.sh's "nothing prebuilt for COMMIT"
[ "${COMPILED:-1}" = 1 ] && { COMMIT=${COMMIT:-} PREBUILT_ONLY=1 bash scripts/gpu/build_compiled.sh; built=$?; }
[ "$built" -eq 2 ] && echo "[demo_gpu] the pure-Python build (COMPILED=0, or no prebuilt extensions of COMMIT)" >&2
[ "$built" -eq 0 ] || [ "$built" -eq 2 ] || exit 3
python3 -c 'import torch, transformers; print("torch", torch.__version__, torch.cuda.get_device_name(0),
                                            "transformers", transformers.__version__)' || exit 3

rc=0
for model in dense hybrid sliding; do
  echo "=== $model" >&2
  python3 -m kvcanary.cli demo --model "$model" --device cuda --baseline --rounds "${ROUNDS:-5}" 2>"$OUT/demo_${model}.progress" \
    | tee "$OUT/demo_${model}.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
done
echo "=== dense, asynchronous batching" >&2
python3 -m kvcanary.cli demo --model dense --device cuda --async-batching --json --quiet | tee "$OUT/demo_dense_async.json"
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
echo "=== hybrid, CUDA graphs" >&2
python3 -m kvcanary.cli demo --model hybrid --device cuda --cuda-graphs --json --quiet | tee "$OUT/demo_hybrid_graphs.json"
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
exit $rc
