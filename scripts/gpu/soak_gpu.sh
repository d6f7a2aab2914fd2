#!/usr/bin/env bash
# `kvcanary soak` on the GPU (issue 19's long run): STEPS canary steps (default 100,000) of the randomized clean
# workload on the lent H200, the canary on its Triton kernels.  Not run by CI.  A device call may run 10 minutes
# and 100,000 steps take longer, so the soak runs detached, in a process session of its own (setsid: the device
# keeps such a process until the machine goes back), and a later call on the same warm machine waits for it:
#   COMMIT=<sha> scripts/gpu/soak_gpu.sh start   # starts it and returns at once
#   scripts/gpu/soak_gpu.sh wait [SECONDS]        # waits (default 560 s) for the end; copies the results to $OUT
# The run's files stay in RUN (default /tmp/kvcanary-soak; $OUT is emptied before each call): env.txt (GPU,
# driver, torch, triton, transformers, commit), soak.json (the result), soak.progress (time-stamped progress
# lines), rc (the exit code, written at the end).  Two pace probes (benchmarks/results/soak-h200/) showed that
# running the two phases in two processes side by side is no faster than one process.
# The transformers 5.24.0 wheel travels in .whl (see transformers_wheel.sh).
set -uo pipefail
STEPS=${STEPS:-100000}
RUN=${RUN:-/tmp/kvcanary-soak}
OUT=${OUT:-$RUN}
case ${1:-} in
  start)
    rm -rf "$RUN" && mkdir -p "$RUN" || exit 3
    source scripts/gpu/transformers_wheel.sh  # the transformers 5.24.0 wheel from .whl
    export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
    { echo "commit ${COMMIT:-unknown} steps $STEPS"
      nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
      python3 -c 'import torch, transformers, triton; print("torch", torch.__version__, "cuda", torch.version.cuda,
        "triton", triton.__version__, "transformers", transformers.__version__)'
    } >"$RUN/env.txt" 2>&1 || { cat "$RUN/env.txt"; exit 3; }
    # shellcheck disable=SC2016  # expanded by the detached shell
    setsid bash -c 'start=$(date +%s)
      python3 -m kvcanary.cli soak --engine transformers --steps "$1" --device cuda --json >"$0/soak.json" \
        2> >(while IFS= read -r line; do echo "$(( $(date +%s) - start ))s $line"; done >"$0/soak.progress")
      echo $? >"$0/rc"' "$RUN" "$STEPS" </dev/null >/dev/null 2>&1 &
    cat "$RUN/env.txt"
    echo "soak started: $STEPS steps, files in $RUN"
    ;;
  wait)
    deadline=$(( $(date +%s) + ${2:-560} ))
    while [ ! -f "$RUN/rc" ] && [ "$(date +%s)" -lt "$deadline" ]; do sleep 5; done
    mkdir -p "$OUT" && [ "$OUT" != "$RUN" ] && cp "$RUN"/* "$OUT"/
    tail -n 4 "$RUN/soak.progress"
    if [ ! -f "$RUN/rc" ]; then echo "soak still running"; exit 5; fi
    echo "soak exit $(cat "$RUN/rc")"
    cat "$RUN/soak.json"
    exit "$(cat "$RUN/rc")"
    ;;
  *) echo "usage: scripts/gpu/soak_gpu.sh start|wait [SECONDS]" >&2; exit 2 ;;
esac
