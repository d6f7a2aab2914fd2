#!/usr/bin/env bash
# The KV digest's checks on a CUDA machine (the lent H200) in one device run, logs and results under $OUT.
# Stages (any subset, default "tests bench"):
#   tests    the compiled digest suites, in two pytest processes beside the other stages (compile-bound)
#   bench    benchmarks/bench_digest.py (COMMIT=<sha> names the results file)
#   probe    benchmarks/digest_mix_probe.py (the same tiles with the mixing alone)
#   profile  Nsight Compute on one 16k-slot stamp launch (what bounds the kernel), if ncu is installed
#   demo     `kvcanary demo --device cuda` with the digest on (dense eager, dense and hybrid under CUDA graphs):
#            the digest verified and stamped in one call after the forward; needs the wheel in .whl (carry [".whl"])
# Usage: COMMIT=$(git rev-parse --short HEAD) scripts/gpu/check_digest.sh tests bench profile
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD/tests:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
stages=${*:-tests bench}
{
  nvidia-smi --query-gpu=name,driver_version --format=csv
  $PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
} 2>&1 | tee "$OUT/env.txt"
pids=()
if [[ " $stages " == *" tests "* ]]; then
  T="timeout ${TESTS_TIMEOUT:-240} $PY -m pytest -q -p no:cacheprovider -W ignore::UserWarning"
  $T tests/test_digest_kernels.py -k list_calls >"$OUT/tests_a.log" 2>&1 &
  pids+=($!)
  $T tests/test_digest_kernels.py tests/test_digest_runtime.py -k "not list_calls" >"$OUT/tests_b.log" 2>&1 &
  pids+=($!)
fi
status=0
for stage in $stages; do
  case $stage in
    tests) continue ;;
    bench) timeout "${BENCH_TIMEOUT:-240}" $PY benchmarks/bench_digest.py --commit "${COMMIT:-unknown}" --out "$OUT" \
             >"$OUT/bench.log" 2>&1 ;;
    probe) timeout 120 $PY benchmarks/digest_mix_probe.py >"$OUT/probe.log" 2>&1 ;;
    demo)
      (source scripts/gpu/transformers_wheel.sh
       for run in "dense 1" "dense 1 --cuda-graphs" "hybrid 0.00390625 --cuda-graphs" "sliding 1 --cuda-graphs"; do
         set -- $run
         echo "=== demo $*"
         timeout 150 $PY -m kvcanary.cli demo --model "$1" --device cuda --digest "$2" "${@:3}" --json --quiet || exit 1
       done) >"$OUT/demo.log" 2>&1 ;;
    profile)
      command -v ncu >/dev/null || { echo "ncu not installed" | tee "$OUT/profile.log"; continue; }
      timeout 240 ncu --kernel-name digest_kernel --launch-skip 1 --launch-count 1 --set detailed \
        $PY -c 'import torch, bench_digest as b
from kvcanary import digest as D
from kvcanary.layout import CanaryGroup
from kvcanary.ops import digest_launchers as dl
from kvcanary.workspace import ViolationLog
dev = torch.device("cuda"); pool = b.Pool(1 << 16, dev); n = 16384
args = (CanaryGroup(num_slots=pool.slots, reserved_slots=()), dl.DeviceLayout.build(pool.layout),
        torch.zeros(pool.slots, dtype=torch.int64, device=dev), D.DigestWorkspace.allocate(n, dev), ViolationLog.allocate(4, dev))
for _ in range(2): dl.stamp_list(*args, torch.randperm(pool.slots, device=dev)[:n])
torch.cuda.synchronize()' >"$OUT/profile.log" 2>&1 ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
  rc=$?
  echo "[stage $stage] exit $rc" | tee -a "$OUT/stages.txt"
  [ $rc -ne 0 ] && status=$rc
done
for p in "${pids[@]}"; do
  wait "$p" || status=$?
done
[ ${#pids[@]} -gt 0 ] && tail -n 2 "$OUT/tests_a.log" "$OUT/tests_b.log" | tee -a "$OUT/stages.txt"
exit $status
