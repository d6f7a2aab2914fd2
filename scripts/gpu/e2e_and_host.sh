#!/usr/bin/env bash
# One device call for issues 14 and 18 (not run by CI).  Stages (STAGES, default "e2e cb demo profile"):
#   compile   the per-step modules compiled with mypyc, in place (scripts/gpu/build_compiled.sh; prebuilt for COMMIT
#             by scripts/gpu/prebuild_compiled.sh, copied in instead of compiled): the stages after it
#             run them; OLD_SRC (a copy of the tree without the extensions) runs the pure-Python build to compare.
#             Give it the time (T_COMPILE, default 480 s): on an H100 machine 200 s was not enough (mypy reads
#             torch's stubs, then one large C file compiles)
#   e2e       benchmarks/bench_e2e.py (the canary inside a graphed Qwen3-0.6B-shaped step)
#   cb        scripts/gpu/cb_qwen3_workload.py (issue 14's generate_batch workload, 4 runs; CB_RUNS, CB_ARGS=--probe)
#   cbprof    the workload's graph runs again, each under the tap profiler (cbprof.txt)
#   old       the same workload against another source tree OLD_SRC (to compare)
#   demo      kvcanary demo --baseline on the three models (host time per step by phase)
#   oncedemo  the same demo with each of the engine's block moves mirrored at once, not queued for the step work
#             (--no-queue-moves; demo_at_once.txt): with demo, an A/B of the queue in one tree and one call
#   warmup    a discarded demo (the first stage of a call ran slower on work the canary does not touch): put it
#             before demo
#   ab        the queue's A/B with the order balanced: a discarded warm-up demo first (see warmup), then per model the
#             queued demo and the one with every move mirrored at once, the first of the two alternating from model to
#             model (demo_ab_queued.txt, demo_ab_at_once.txt)
#   olddemo   the same demo against OLD_SRC (OLD_DEMO_MODELS, default dense hybrid; OLD_ROUNDS pairs, default 3):
#             a before/after in one call
#   profile   scripts/gpu/host_profile.py (where the host time goes; PROFILE_MODELS, default dense; PROFILE_TARGETS,
#             default tap: tap, mirror, setup)
#   setup     scripts/gpu/setup_costs.py on SETUP_MODELS (default dense hybrid): each piece of a cache's set-up, 3 runs
#   probe     scripts/gpu/share_probe.py on PROBE_MODELS (default hybrid): the share beyond the tap's host time
#   phases    scripts/gpu/phase_probe.py on PHASE_MODELS (default dense hybrid sliding): where in the engine's loop
#             the time the canary adds lands (PAIRS alternating pairs, default 5)
#   steptimes scripts/gpu/step_times.py on STEPTIME_MODELS (default dense hybrid): every step's seconds of PAIRS
#             alternating pairs (default 6), free and pinned to PIN CPUs (default 0: not): how the share's pairs spread;
#             with SPIN_US, against a stand-in spinning that long a step where the tap runs (the canary off)
#   firststeps scripts/gpu/first_steps.py on FIRST_MODELS (default dense hybrid): the first steps of a run profiled
#   oldphases the same against the tree above OLD_SRC (an A/B of a change to the engine-side hooks in one call)
#   timeline  scripts/gpu/device_timeline.py on TIMELINE_MODELS (default dense): the demo traced with the canary off
#             and on (GPU busy time, the canary's kernels, the host's time in each CUDA runtime call)
#   interference scripts/gpu/launch_interference.py: does canary-like work between two steps slow the engine's next
#             step (its Python leaving the caches cold, or its CUDA calls)?
#   launches  scripts/gpu/graph_launches.py on LAUNCH_MODELS (default dense hybrid): the demo's step graphs, their
#             nodes by type and the host time of one launch (GPU idle, and behind a stand-in engine step)
#   tapsteps  scripts/gpu/tap_steps.py on TAPSTEP_MODELS (default dense): which steps lift the tap's mean over its median
#   mirrorcosts scripts/gpu/mirror_costs.py on MIRROR_MODELS (default hybrid dense): the mirror's pieces, each timed
#             (the pure-Python tree: put this stage before compile)
#   hoststep  benchmarks/bench_host_step.py (host_step and eager before/after_forward)
#   oldhost   the same benchmark of the tree above OLD_SRC (its own copy of it), results under $OUT/old
#   kernels   the compiled kernel suites (cases, same-step, graph) and compute-sanitizer memcheck
#   keys      scripts/gpu/graph_keys.py on the dense and hybrid demo (which key parts vary among eager steps)
#   opcosts   scripts/gpu/op_costs.py (host time of the small CUDA calls the translation makes)
#   captures  scripts/gpu/capture_costs.py (a step graph's capture piece by piece, the GPU idle and busy)
#   gputests  the GPU-marked tests no other script runs (translation never waits on the device, the step
#             graphs against eager launches, the mirror of offloads and restores and vLLM's block moves never
#             wait) and the translation kernel's, the step close's and the outbox publish's suites compiled, the
#             publish's under compute-sanitizer memcheck too (gputests.log)
# Each stage has its own time limit and writes under $OUT as it goes, so a cut-short call keeps what
# finished.  Needs the transformers 5.24.0 wheel in .whl (see transformers_wheel.sh) and COMMIT=<sha>.
set -uo pipefail
OUT=${OUT:-/tmp/kvcanary-e2e-host}
mkdir -p "$OUT"
source scripts/gpu/transformers_wheel.sh  # the transformers 5.24.0 wheel from .whl
BASE_PATH=${PYTHONPATH:-}
export PYTHONPATH=$PWD/src:$PWD/tests${BASE_PATH:+:$BASE_PATH}
export PYTHONUNBUFFERED=1
export COMMIT=${COMMIT:-unknown}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)'
} 2>&1 | tee -a "$OUT/run.log"
stage() { echo "=== $1 ($(date -u +%T))" | tee -a "$OUT/run.log" >&2; }
# demo_run FILE MODEL [FLAG...]: the timed demo (--baseline) of MODEL with FLAGs, appended to $OUT/FILE
demo_run() {
  local file=$1 model=$2
  shift 2
  timeout "${T_DEMO:-120}" python3 -m kvcanary.cli demo --model "$model" --device cuda --baseline --rounds "${ROUNDS:-5}" \
    "$@" --quiet >>"$OUT/$file" 2>&1
}
# warm_up: a short demo whose output is discarded
warm_up() {
  timeout "${T_DEMO:-120}" python3 -m kvcanary.cli demo --model dense --device cuda --requests 16 --quiet >/dev/null 2>&1
}
for s in ${STAGES:-e2e cb demo profile}; do
  stage "$s"
  case $s in
    compile) timeout "${T_COMPILE:-480}" bash scripts/gpu/build_compiled.sh >"$OUT/compile.log" 2>&1
             echo "[compile exit $?]" | tee -a "$OUT/run.log" ;;
    e2e) timeout "${T_E2E:-170}" python3 benchmarks/bench_e2e.py --commit "$COMMIT" --out "$OUT" \
           ${E2E_POINTS:+--points $E2E_POINTS} >>"$OUT/run.log" 2>&1 ;;
    cb) timeout "${T_CB:-150}" python3 scripts/gpu/cb_qwen3_workload.py --out "$OUT" ${CB_RUNS:+--runs $CB_RUNS} ${CB_ARGS:-} \
          >>"$OUT/run.log" 2>&1 ;;
    cbprof) timeout "${T_CB:-150}" python3 scripts/gpu/cb_qwen3_workload.py --out "$OUT/prof" \
              --runs b1_graphs,b32_graphs --profile b1_graphs,b32_graphs >"$OUT/cbprof.txt" 2>&1 ;;
    old) PYTHONPATH=$PWD/$OLD_SRC${BASE_PATH:+:$BASE_PATH} timeout "${T_OLD:-90}" python3 \
           scripts/gpu/cb_qwen3_workload.py --out "$OUT" --name cb_qwen3_old --runs b32_graphs,b1_graphs,b32_eager \
           >>"$OUT/run.log" 2>&1 ;;
    demo) for model in ${DEMO_MODELS:-dense hybrid sliding}; do demo_run demo.txt "$model"; done ;;
    oncedemo) for model in ${DEMO_MODELS:-dense hybrid sliding}; do
                demo_run demo_at_once.txt "$model" --no-queue-moves
              done ;;
    warmup) warm_up ;;
    ab) warm_up
        i=0
        for model in ${DEMO_MODELS:-dense hybrid sliding}; do
          sides=("queued:" "at_once:--no-queue-moves")
          [ $((i % 2)) = 1 ] && sides=("at_once:--no-queue-moves" "queued:")
          for side in "${sides[@]}"; do
            demo_run "demo_ab_${side%%:*}.txt" "$model" ${side#*:}
          done
          i=$((i + 1))
        done ;;
    olddemo) for model in ${OLD_DEMO_MODELS:-dense hybrid}; do
               PYTHONPATH=$PWD/$OLD_SRC${BASE_PATH:+:$BASE_PATH} timeout "${T_DEMO:-60}" python3 -m kvcanary.cli demo \
                 --model "$model" --device cuda --baseline --rounds "${OLD_ROUNDS:-3}" --quiet >>"$OUT/demo_old.txt" 2>&1
             done ;;
    profile) for model in ${PROFILE_MODELS:-dense}; do
               timeout "${T_PROF:-45}" python3 scripts/gpu/host_profile.py --model "$model" --targets "${PROFILE_TARGETS:-tap}" \
                 >>"$OUT/profile.txt" 2>&1
             done ;;
    setup) for model in ${SETUP_MODELS:-dense hybrid}; do
             timeout "${T_SETUP:-90}" python3 scripts/gpu/setup_costs.py --model "$model" --runs 3 >"$OUT/setup_$model.txt" 2>&1
           done ;;
    probe) for model in ${PROBE_MODELS:-hybrid}; do
             timeout "${T_PROBE:-120}" python3 scripts/gpu/share_probe.py --model "$model" --top 30 \
               >"$OUT/probe_$model.txt" 2>&1
           done ;;
    steptimes) for model in ${STEPTIME_MODELS:-dense hybrid}; do
                 timeout "${T_STEPTIMES:-200}" python3 scripts/gpu/step_times.py --model "$model" --pairs "${PAIRS:-6}" \
                   --pin "${PIN:-0}" ${SPIN_US:+--spin-us $SPIN_US} --out "$OUT" >"$OUT/steptimes_$model${SPIN_US:+_spin$SPIN_US}.txt" 2>&1
               done ;;
    firststeps) for model in ${FIRST_MODELS:-dense hybrid}; do
                  timeout "${T_FIRST:-90}" python3 scripts/gpu/first_steps.py --model "$model" >"$OUT/first_$model.txt" 2>&1
                done ;;
    phases) for model in ${PHASE_MODELS:-dense hybrid sliding}; do
              timeout "${T_PHASES:-150}" python3 scripts/gpu/phase_probe.py --model "$model" --pairs "${PAIRS:-5}" \
                >"$OUT/phases_$model.txt" 2>&1
            done ;;
    oldphases) for model in ${PHASE_MODELS:-dense hybrid sliding}; do
                 PYTHONPATH=$PWD/$OLD_SRC${BASE_PATH:+:$BASE_PATH} timeout "${T_PHASES:-150}" python3 \
                   scripts/gpu/phase_probe.py --model "$model" --pairs "${PAIRS:-5}" >"$OUT/phases_old_$model.txt" 2>&1
               done ;;
    launches) for model in ${LAUNCH_MODELS:-dense hybrid}; do
                timeout "${T_LAUNCHES:-90}" python3 scripts/gpu/graph_launches.py --model "$model" \
                  >"$OUT/launches_$model.txt" 2>&1
              done ;;
    timeline) for model in ${TIMELINE_MODELS:-dense}; do
                timeout "${T_TIMELINE:-120}" python3 scripts/gpu/device_timeline.py --model "$model" \
                  >"$OUT/timeline_$model.txt" 2>&1
              done ;;
    interference) timeout "${T_INTERFERENCE:-120}" python3 scripts/gpu/launch_interference.py >"$OUT/interference.txt" 2>&1 ;;
    tapsteps) for model in ${TAPSTEP_MODELS:-dense}; do
                timeout "${T_TAPSTEPS:-90}" python3 scripts/gpu/tap_steps.py --model "$model" >"$OUT/tapsteps_$model.txt" 2>&1
              done ;;
    mirrorcosts) for model in ${MIRROR_MODELS:-hybrid dense}; do
                   timeout "${T_MIRROR:-60}" python3 scripts/gpu/mirror_costs.py --model "$model" --runs 3 \
                     >"$OUT/mirror_costs_$model.txt" 2>&1
                 done ;;
    hoststep) timeout "${T_HOST:-60}" python3 benchmarks/bench_host_step.py --commit "$COMMIT" --results-dir "$OUT" \
                --steps 2000 --warmup 200 >>"$OUT/run.log" 2>&1 ;;
    oldhost) PYTHONPATH=$PWD/$OLD_SRC${BASE_PATH:+:$BASE_PATH} timeout "${T_HOST:-60}" python3 \
               "$(dirname "$OLD_SRC")/benchmarks/bench_host_step.py" --commit "${OLD_COMMIT:-old}" \
               --results-dir "$OUT/old" --steps 2000 --warmup 200 >>"$OUT/run.log" 2>&1 ;;
    kernels) timeout "${T_KERNELS:-330}" python3 -m pytest -q -x -p no:cacheprovider -W ignore::UserWarning \
               tests/test_kernels_cases.py tests/test_kernels_same_step.py tests/test_kernels_graph.py >"$OUT/kernels.log" 2>&1
             PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${T_SANITIZE:-90}" compute-sanitizer --tool memcheck \
               --error-exitcode 99 --print-limit 20 python3 scripts/gpu/sanitize_kernels.py "${SANITIZE_CASES:-6}" \
               >>"$OUT/kernels.log" 2>&1
             echo "sanitizer exit $?" >>"$OUT/kernels.log" ;;
    keys) for model in dense hybrid; do
            timeout "${T_KEYS:-60}" python3 scripts/gpu/graph_keys.py --model "$model" >>"$OUT/keys.txt" 2>&1
          done ;;
    captures) timeout "${T_CAPT:-60}" python3 scripts/gpu/capture_costs.py >"$OUT/capture_costs.txt" 2>&1 ;;
    opcosts) timeout 60 python3 scripts/gpu/op_costs.py >"$OUT/op_costs.txt" 2>&1 ;;
    gputests) timeout "${T_GPUTESTS:-60}" python3 -m pytest -q -p no:cacheprovider -m gpu \
                tests/test_adapter_transformers_cost.py tests/test_runtime_step_graphs.py tests/test_runtime_streams.py \
                tests/test_adapter_transformers_mirror.py tests/test_layout_block_index.py tests/test_runtime_publish.py \
                >>"$OUT/gputests.log" 2>&1
              timeout "${T_GPUTESTS:-60}" python3 -m pytest -q -p no:cacheprovider \
                tests/test_adapter_transformers_translate_kernel.py tests/test_adapter_transformers_steady_step.py \
                tests/test_runtime_step_close.py tests/test_runtime_publish.py tests/test_adapter_transformers_staged_upload.py \
                tests/test_queued_moves.py >>"$OUT/gputests.log" 2>&1
              PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${T_SANITIZE:-120}" compute-sanitizer --tool memcheck \
                --error-exitcode 99 --print-limit 20 python3 -m pytest -q -p no:cacheprovider tests/test_runtime_publish.py \
                tests/test_queued_moves.py \
                >>"$OUT/gputests.log" 2>&1
              echo "publish sanitizer exit $?" >>"$OUT/gputests.log" ;;
    *) echo "unknown stage $s" | tee -a "$OUT/run.log" ;;
  esac
  echo "[$s exit $?]" | tee -a "$OUT/run.log" >&2
done
stage done
