#!/usr/bin/env bash
# Every GPU check a submitted commit needs, in two device calls (a machine stays warm 30 s between them):
#   suites   the compiled kernel suites (case, same-step, graph; differential in three; digest) in five processes
#            beside compute-sanitizer memcheck on corrupted tables (link kernels, then the digest kernel):
#            compile-bound, so run together
#   benches  the kernel table, the digest benchmark, the canary's graph node by node and bench_e2e one after another (timings alone on the GPU)
#            and the GPU-marked adapter test; needs the transformers wheel in .whl (carry [".whl"])
# Logs and results in $OUT/<stage>.tgz (one file: the device returns at most 8).  Usage: COMMIT=<sha> scripts/gpu/final_checks.sh suites|benches
set -uo pipefail
cd "$(dirname "$0")/../.."
stage=${1:?suites or benches}
OUT=${OUT:-gpu-out}
COMMIT=${COMMIT:-unknown}
export PYTHONPATH="$PWD/src:$PWD/tests:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="$OUT/$stage"
mkdir -p "$out"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  echo "commit $COMMIT"; } >"$out/env.txt" 2>&1
T="timeout ${TESTS_TIMEOUT:-500} python3 -m pytest -q -p no:cacheprovider -W ignore::UserWarning"
case $stage in
  suites)
    $T tests/test_kernels_cases.py tests/test_kernels_same_step.py tests/test_kernels_graph.py \
      tests/test_runtime_phase_mark.py >"$out/link.log" 2>&1 &
    a=$!
    # the differential's 14 chunks in three processes (compile-bound: one process did not finish in 440 s)
    D=tests/test_kernels_differential.py
    b=""
    for part in 0 1 2; do
      ids=()
      for i in $(seq "$part" 3 10); do ids+=("$D::test_corrupted_batches_match_reference[$i]"); done
      ids+=("$D::test_clean_batches_match_reference[$part]")
      $T "${ids[@]}" >"$out/differential$part.log" 2>&1 &
      b="$b $!"
    done
    $T tests/test_digest_kernels.py tests/test_digest_runtime.py >"$out/digest.log" 2>&1 &
    c=$!
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${SANITIZE_TIMEOUT:-500}" compute-sanitizer --tool memcheck \
      --error-exitcode 99 --print-limit 20 python3 scripts/gpu/sanitize_kernels.py "${SANITIZE_CASES:-16}" \
      >"$out/sanitizer.log" 2>&1
    echo "sanitizer exit $?" >>"$out/stages.txt"
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${SANITIZE_TIMEOUT:-500}" compute-sanitizer --tool memcheck \
      --error-exitcode 99 --print-limit 20 python3 scripts/gpu/sanitize_digest.py "${SANITIZE_DIGEST_ROUNDS:-12}" \
      >"$out/sanitizer_digest.log" 2>&1
    echo "digest sanitizer exit $?" >>"$out/stages.txt"
    for p in $a $b $c; do wait $p; echo "suite pid $p exit $?" >>"$out/stages.txt"; done
    tail -n 1 "$out"/link.log "$out"/differential?.log "$out"/digest.log "$out"/sanitizer.log "$out"/sanitizer_digest.log \
      >>"$out/stages.txt" ;;
  benches)
    timeout 150 python3 benchmarks/bench_kernels.py --commit "$COMMIT" --out "$out" >"$out/bench_kernels.log" 2>&1
    echo "bench_kernels exit $?" >>"$out/stages.txt"
    timeout 200 python3 benchmarks/bench_digest.py --commit "$COMMIT" --out "$out" >"$out/bench_digest.log" 2>&1
    echo "bench_digest exit $?" >>"$out/stages.txt"
    timeout 60 python3 benchmarks/canary_graph_profile.py --commit "$COMMIT" --out "$out" >"$out/canary_graph.log" 2>&1
    echo "canary_graph_profile exit $?" >>"$out/stages.txt"
    OUT="$out" COMMIT="$COMMIT" STAGES="e2e gputests" T_E2E=170 bash scripts/gpu/e2e_and_host.sh >"$out/e2e.log" 2>&1
    echo "e2e exit $?" >>"$out/stages.txt" ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
cat "$out/stages.txt"
tar czf "$OUT/$stage.tgz" -C "$out" . && rm -rf "$out"
