#!/usr/bin/env bash
# `kvcanary demo` on the GPU: the CPU demo's workload (64 prompts x 2 sampled sequences, shared prefixes,
# forks, CPU offload) on the lent H200, with the canary's GPU path (Backend.AUTO -> Triton kernels), for
# the three model kinds, plus runs with the engine's asynchronous batching and its CUDA graphs (padded
# batches, warm-up forwards, graph replays the canary reads after).  The three main runs also time the
# same workload with the canary off (--baseline) and prints the canary's share of step time.
#
# Not run by CI.  The device image has transformers 5.17.0 and nothing can be fetched there, so the
# transformers 5.24.0 wheel (pure Python; its other requirements are already in the image) travels in .whl:
#   here, once, in the repo root:
#     echo /.whl/ >> .git/info/exclude
#     python3 -m pip download --no-deps --only-binary=:all: -d .whl transformers==5.24.0
#   device call: carry [".whl"], command: bash scripts/gpu/demo_gpu.sh
# Writes $OUT/demo_<model>.txt (summaries), $OUT/demo_dense_async.json and $OUT/demo_hybrid_graphs.json;
# exit 0 only if every run passed.
set -uo pipefail
OUT=${OUT:-/tmp/kvcanary-demo-gpu}
mkdir -p "$OUT"
if compgen -G ".whl/transformers-5.24.0-*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/transformers-5.24.0-*.whl || exit 3
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
python3 -c 'import torch, transformers; print("torch", torch.__version__, torch.cuda.get_device_name(0),
                                            "transformers", transformers.__version__)' || exit 3

rc=0
for model in dense hybrid sliding; do
  echo "=== $model" >&2
  python3 -m kvcanary.cli demo --model "$model" --device cuda --baseline 2>"$OUT/demo_${model}.progress" \
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
