"""Instructions and simulated cache-line misses of one steady translation step, counted by cachegrind (no GPU needed).

Wall-clock times of the host path move by 10-50 % between runs on a shared CPU (``bench_translate.py --cold`` read
60-65 us at batch 1 in one hour and 70-116 us in the next, for the same code), so a change of a few microseconds
cannot be told from noise that way.  This counts instead: ``bench_translate.py``'s workload (one full-attention
group, the kernel path laid out as on CUDA, two engine buffer sets: every step after the first two is steady) runs
under valgrind's cachegrind with one thread, address randomisation off and a fixed hash seed, so a run's counts
repeat to the instruction.  A figure per step is the difference between a run of ``steps + 10`` steps and one of
10, divided by ``steps``, less the same difference for the workload's own per-step work (a run that builds the
steps but translates only the first two).  The simulated caches are tiny (1 KB first levels, a 4 KB last level),
so the last level's misses approximate the cache lines a step touches: what a step costs when it runs with the
caches cold, as it does between two forwards.

Writes ``{"scenario": "steady_translate_b<batch>", "instructions", "ll_misses", ...}`` records into
``<out>/cpu-dry-run-<commit>-instructions.json`` when ``--out`` is given (through ``bench_common.save_records``).

Usage: PYTHONPATH=src:benchmarks python benchmarks/step_instructions.py [--batch 1,16] [--steps 1000]
       [--commit <sha>] [--out DIR]   (needs valgrind; a pair of runs takes a few minutes)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BASE_STEPS = 10
COUNTS = re.compile(r"I\s+refs:\s+([\d,]+).*?LL misses:\s+([\d,]+)", re.S)
CACHES = ("--I1=1024,2,64", "--D1=1024,2,64", "--LL=4096,2,64")


def workload(batch: int, steps: int, translate_all: bool) -> None:
    """The counted process: ``steps`` steps of ``bench_translate.py``'s requests, each translated when
    ``translate_all`` (else only the first two, which build the translator's kept state)."""
    import bench_translate as bt
    from kvcanary.adapters.transformers_cb.translate import StepTranslator

    reqs = bt.Requests(batch, 512, steps + 2, "cpu")
    reqs.use_buffer_sets(2)
    tr = StepTranslator(
        [reqs.geometry], max_batch=batch, max_context=512 + steps + 8, device="cpu", kernel=True, static=True
    )
    built = [reqs.step() for _ in range(steps + 2)]
    for kwargs, host in built if translate_all else built[:2]:
        tr.translate(kwargs, host, defer=True)
    if translate_all and tr.steady_steps != steps:
        raise SystemExit(f"expected {steps} steady steps, got {tr.steady_steps}")


def count(batch: int, steps: int, translate_all: bool) -> tuple[int, int]:
    """(instructions, last-level misses) of one counted run."""
    env = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    worker = [sys.executable, __file__, "--worker", str(batch), str(steps), str(int(translate_all))]
    grind = ["valgrind", "--tool=cachegrind", "--cache-sim=yes", *CACHES, "--cachegrind-out-file=/dev/null"]
    out = subprocess.run(["setarch", "-R", *grind, *worker], env=env, capture_output=True, text=True, check=True)
    found = COUNTS.search(out.stderr)
    if found is None:
        raise RuntimeError(f"no cachegrind summary in:\n{out.stderr[-2000:]}")
    return int(found.group(1).replace(",", "")), int(found.group(2).replace(",", ""))


def per_step(batch: int, steps: int) -> dict[str, object]:
    """One record: the steady step's own instructions and last-level misses (the workload's taken out)."""
    keys = [(mode, n) for mode in (True, False) for n in (BASE_STEPS, BASE_STEPS + steps)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # counts do not depend on it
        runs = dict(zip(keys, pool.map(lambda k: count(batch, k[1], k[0]), keys), strict=True))

    def slope(mode: bool, i: int) -> float:
        return (runs[mode, BASE_STEPS + steps][i] - runs[mode, BASE_STEPS][i]) / steps

    return {
        "scenario": f"steady_translate_b{batch}",
        "batch": batch,
        "steps": steps,
        "instructions": round(slope(True, 0) - slope(False, 0)),
        "ll_misses": round(slope(True, 1) - slope(False, 1)),
        "workload_instructions": round(slope(False, 0)),
    }


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        workload(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1")
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", default="1,16", help="batch sizes, comma-separated")
    p.add_argument("--steps", type=int, default=1000, help="steady steps counted (beyond the base run's)")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", default=None, help="store the records here as cpu-dry-run-<commit>-instructions.json")
    args = p.parse_args()
    missing = [tool for tool in ("valgrind", "setarch") if shutil.which(tool) is None]
    if missing:
        p.error(f"needs {' and '.join(missing)} on the PATH")
    records = []
    for batch in (int(b) for b in args.batch.split(",")):
        print(f"batch {batch}: four counted runs...", file=sys.stderr, flush=True)
        records.append(per_step(batch, args.steps))
        print(json.dumps(records[-1]), flush=True)
    if args.out is not None:
        import torch

        from bench_common import meta, save_records

        m = meta(args.commit, torch.device("cpu")) | {"valgrind": subprocess.getoutput("valgrind --version")}
        save_records(args.out, m, args.commit, "-instructions.json", records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
