"""Count the 64-bit integer divisions in the paged link kernels' PTX (sm_90, compiled on the CPU, no GPU).

An int64 quotient or remainder by a runtime value compiles to a call of about 80 SASS instructions a lane; the
kernels page every position they resolve (``kernels/indexing.table_entry``), so one there costs each verified
entry four such calls.  Positions are paged in 32 bits; the only 64-bit divisions left are on the violation
log's paths (a row's place in the ring of the last K rows).  Prints each paged variant of the verify and stamp
kernels with its count and exits 1 when one has more than :data:`LOG_PATHS`.

Usage: PYTHONPATH=src:tests python scripts/gpu/kernel_divisions.py [cases]
"""

from __future__ import annotations

import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels: real JIT functions, not interpreted ones

import torch
import triton
from compile_offline import Recorder
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import gen
from kvcanary.ops import launchers
from kvcanary.workspace import GroupState

LOG_PATHS = 2  # the log's ring index (store_rows), in the main finalize and the re-derived items' one
DIV64 = re.compile(r"\b(?:div|rem)\.[su]64\b")


def paged_variants(cases: int) -> dict:
    """The verify and stamp launches of ``cases`` random clean cases whose group is paged, by variant."""
    os.environ["TRITON_INTERPRET"] = "1"  # only so that the launchers accept CPU tensors (nothing runs)
    seen: dict = {}
    for name in ("verify_kernel", "stamp_kernel"):
        setattr(launchers, name, Recorder(getattr(launchers, name), seen))
    for seed in range(cases):
        case = gen.random_case(seed, corrupt=False)
        if case.group.page_size == 1:
            continue
        state = GroupState(case.group, case.records, case.ws, case.log)
        launchers.plan_verify(state, case.batch, case.caps.verify_entries)
        launchers.plan_verify(state, case.batch, case.caps.verify_entries, mark=torch.zeros(1, dtype=torch.int64))
        launchers.stamp(state, case.batch)
    os.environ.pop("TRITON_INTERPRET")
    # Each variant's PAGED flag at its own kernel's parameter index (key[0]: the kernel's name).
    return {k: v for k, v in seen.items() if v[1].get((launchers.__dict__[k[0]].fn.arg_names.index("PAGED"),))}


def main() -> int:
    variants = paged_variants(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
    if not variants:
        print("no paged case among the random cases: raise the count")
        return 2
    worst = 0
    for (kname, _s, _c, warps, _m), (sig, consts, _w, _mx) in sorted(variants.items(), key=lambda kv: str(kv[0])):
        fn = launchers.__dict__[kname].fn
        ptx = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": warps}).asm["ptx"]  # fmt: skip
        n = len(DIV64.findall(ptx))
        worst = max(worst, n)
        flags = {fn.arg_names[k[0]]: v for k, v in consts.items()}
        print(f"{kname} warps={warps} {flags}: {n} 64-bit divisions", flush=True)
    print(f"triton {triton.__version__}: {len(variants)} paged variants, at most {worst} (allowed {LOG_PATHS})")
    return 0 if worst <= LOG_PATHS else 1


if __name__ == "__main__":
    sys.exit(main())
