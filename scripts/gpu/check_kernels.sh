#!/usr/bin/env bash
# Kernel checks and benchmarks on a CUDA machine (the lent H200), logs under $OUT (default ./gpu-out).
# Stages (any order, any subset): tests sanitize sweep bench breakdown compare ncu ncudeep.  COMMIT=<sha> names the
# results file; KERNEL_TESTS overrides the test files; NCU_SCENARIOS the scenarios ncu profiles; OLD_SRC and PAGE
# the compare stage's other tree and page size.
# Usage: scripts/gpu/check_kernels.sh tests sanitize sweep
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
status=0
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  $PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
} 2>&1 | tee "$OUT/env.txt"

for stage in "$@"; do
  t0=$(date +%s)
  case $stage in
    tests)  # the differential, hand-case and CUDA-graph suites, compiled
      # shellcheck disable=SC2086
      timeout "${TESTS_TIMEOUT:-330}" $PY -m pytest -q -p no:cacheprovider -W ignore::UserWarning --durations=8 \
        ${KERNEL_TESTS:-tests/test_kernels_graph.py tests/test_kernels_cases.py tests/test_kernels_same_step.py \
        tests/test_kernels_differential.py} 2>&1 | tee "$OUT/tests.log"
      ;;
    sanitize)  # every tensor its own allocation, so memcheck sees any access outside it
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${SANITIZE_TIMEOUT:-240}" compute-sanitizer --tool memcheck \
        --error-exitcode 99 --print-limit 20 $PY scripts/gpu/sanitize_kernels.py "${SANITIZE_CASES:-16}" 2>&1 \
        | tee "$OUT/sanitizer.log"
      ;;
    sweep)
      timeout "${SWEEP_TIMEOUT:-200}" $PY benchmarks/kernel_sweep.py --hand-picked --rotations 4 --replays 15 \
        --commit "${COMMIT:-unknown}" --out "$OUT" --best-json "$OUT/best_tuning.json" 2>&1 \
        | tee "$OUT/sweep.log"
      ;;
    bench)
      timeout "${BENCH_TIMEOUT:-300}" $PY benchmarks/bench_kernels.py --commit "${COMMIT:-unknown}" --out "$OUT" \
        --tuning-json "$OUT/best_tuning.json" 2>&1 \
        | tee "$OUT/bench.log"
      ;;
    compare)  # the goal scenarios under the default tuning, this tree against OLD_SRC (another tree's src, carried
      # with the call), with token tables and with block tables of PAGE slots (default 16): a kernel change's
      # before and after on one machine
      for tree in old new; do
        src=$PWD/src
        [ "$tree" = old ] && src=$PWD/${OLD_SRC:?set OLD_SRC to the other tree src folder}
        for page in 1 "${PAGE:-16}"; do
          PYTHONPATH="$src:$PWD/tests:$PWD/benchmarks" timeout "${COMPARE_TIMEOUT:-150}" \
            $PY benchmarks/kernel_sweep.py --hand-picked --picked default --page "$page" --rotations 4 --replays 15 \
            --commit "$tree" --out "$OUT/compare" 2>&1 \
            | grep -E ' us$' | sed "s/^/$tree /" | tee -a "$OUT/compare.log"
        done
      done
      ;;
    breakdown)  # plan + verify alone, the step, and the three-launch form
      timeout "${BREAKDOWN_TIMEOUT:-120}" $PY benchmarks/bench_kernels.py --breakdown --rotations 4 --replays 30 2>&1 \
        | tee "$OUT/breakdown.log"
      ;;
    ncu)  # per-kernel duration, occupancy and memory traffic of a few eager steps (clocks left alone)
      timeout "${NCU_TIMEOUT:-150}" ncu --clock-control none -k 'regex:verify_kernel|stamp_kernel|plan_kernel' \
        --metrics gpu__time_duration.sum,launch__grid_size,launch__registers_per_thread,launch__block_size,\
sm__warps_active.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed,\
dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,\
dram__bytes.sum,lts__t_sectors_op_atom.sum,lts__t_sectors_op_red.sum,lts__t_sectors.sum \
        $PY benchmarks/bench_kernels.py --eager-steps 2 --rotations 2 \
        --scenarios "${NCU_SCENARIOS:-decode_b1_p512,decode_b32_p4k,decode_b256_p16k,prefill_16k,window4k_b128_p16k}" \
        2>&1 | tee "$OUT/ncu.log"
      ;;
    ncudeep)  # where a kernel's time goes: occupancy, stall reasons, memory tables and the top stall lines, one step
      timeout "${NCU_TIMEOUT:-200}" ncu --clock-control none -k 'regex:verify_kernel|stamp_kernel|plan_kernel' \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section MemoryWorkloadAnalysis_Tables --section SourceCounters \
        $PY benchmarks/bench_kernels.py --eager-steps 1 --rotations 2 \
        --scenarios "${NCU_SCENARIOS:-decode_b1_p512,decode_b32_p4k,decode_b256_p16k,prefill_16k,window4k_b128_p16k}" \
        2>&1 | tee "$OUT/ncudeep.log"
      ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
  rc=$?
  echo "[stage $stage] exit $rc in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/stages.txt"
  [ $rc -ne 0 ] && status=$rc
done
exit $status
