#!/usr/bin/env bash
# `kvcanary soak` on the GPU (issue 19's long run): STEPS canary steps (default 100,000) of the randomized clean
# workload on the lent H200, the canary on its Triton kernels.  Not run by CI.  The soak's two phases (dense,
# hybrid: STEPS/2 each, the same seed, exactly what one `kvcanary soak` process runs one after the other) run
# side by side in two processes, one engine and one canary each, so that the run fits in one call.  The transformers 5.24.0 wheel
# travels in .whl (see transformers_wheel.sh).  A call may run 10 minutes at most, so after PROBE_S seconds the run's
# pace is projected from its progress lines and the run is stopped at once if it cannot finish within
# BUDGET_S (exit 4), instead of spending the device time for nothing.
# Writes $OUT/soak_<model>.json (each phase's result), $OUT/soak_<model>.progress (progress lines, time-stamped).
set -uo pipefail
STEPS=${STEPS:-100000}
PROBE_S=${PROBE_S:-75}
BUDGET_S=${BUDGET_S:-540}
OUT=${OUT:-/tmp/kvcanary-soak-gpu}
mkdir -p "$OUT"
source scripts/gpu/transformers_wheel.sh  # the transformers 5.24.0 wheel from .whl
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
python3 -c 'import torch, transformers, triton; print("torch", torch.__version__, torch.version.cuda,
  torch.cuda.get_device_name(0), "triton", triton.__version__, "transformers", transformers.__version__)' || exit 3
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
start=$(date +%s)
PHASES=dense,hybrid  # one process, both phases; its steps: STEPS
PROCS=1
if [ "${PARALLEL:-0}" = 1 ]; then PHASES="dense hybrid"; PROCS=2; fi  # one process a phase; each: STEPS/2
pids=()
for model in $PHASES; do
  python3 -m kvcanary.cli soak --engine transformers --models "$model" --steps $(( STEPS / PROCS )) --device cuda \
    --json >"$OUT/soak_$model.json" \
    2> >(while IFS= read -r line; do echo "$(( $(date +%s) - start ))s $line"; done >"$OUT/soak_$model.progress") &
  pids+=($!)
done
sleep "$PROBE_S"
elapsed=$(( $(date +%s) - start ))
for model in $PHASES; do
  done_steps=$(grep -o 'step [0-9,]*' "$OUT/soak_$model.progress" | tail -1 | tr -dc 0-9)
  echo "after ${elapsed}s: $model at step ${done_steps:-0}"
  if [ -z "$done_steps" ] || [ $(( elapsed * STEPS / PROCS / done_steps )) -gt "$BUDGET_S" ]; then
    echo "$model: projected $(( elapsed * STEPS / PROCS / ${done_steps:-1} ))s > ${BUDGET_S}s: stopped" >&2
    kill "${pids[@]}"; wait; cat "$OUT"/soak_*.progress; exit 4
  fi
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
echo "soak exit $rc after $(( $(date +%s) - start ))s"
for model in $PHASES; do tail -n 3 "$OUT/soak_$model.progress"; cat "$OUT/soak_$model.json"; done
exit $rc
