"""Compile the canary's kernels for sm_90 on a machine without a GPU (Triton's front end, LLVM and ptxas).

The interpreter runs kernels as Python and accepts code the compiler refuses (a loop-carried variable whose
type changes, say); this catches that before device time is spent.  The kernels' arguments come from the
launchers themselves, run on CPU tensors with the kernels swapped for recorders, over the differential
test's random cases (so every combination of static flags that they reach is compiled).  Each variant's line
ends with a hash of its cubin: two source trees whose lines match compile to the same machine code.
Usage: PYTHONPATH=src:tests python scripts/gpu/compile_offline.py [cases]
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels: real JIT functions, not interpreted ones

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import gen
from kvcanary.ops import launchers
from kvcanary.ops import reference as ref
from kvcanary.workspace import GroupState

_TYPES = {torch.int32: "*i32", torch.int64: "*i64", torch.int16: "*i16", torch.int8: "*i8", torch.uint8: "*u8"}


class Recorder:
    def __init__(self, fn: triton.runtime.JITFunction, seen: dict) -> None:
        self.fn, self.seen = fn, seen

    def __getitem__(self, grid: object):
        def launch(*args: object, **kwargs: object) -> None:
            names = [p.name for p in self.fn.params]
            sig, consts = {}, {}
            for name, value in zip(names, args, strict=False):
                if isinstance(value, torch.Tensor):
                    sig[name] = _TYPES[value.dtype]
                else:
                    sig[name] = "i32" if -(2**31) <= int(value) < 2**31 else "i64"
            warps = int(kwargs.pop("num_warps", 4))
            for name, value in kwargs.items():
                sig[name] = "constexpr"
                consts[(names.index(name),)] = value
            key = (self.fn.__name__, tuple(sorted(sig.items())), tuple(sorted(consts.items())), warps)
            self.seen.setdefault(key, (sig, consts, warps))

        return launch


def _registers(cubin: bytes) -> str:
    """Registers per thread and spill stores, from the cuobjdump that ships with Triton."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", out)
    return f"{m.group(1)} (stack {m.group(2)})" if m else "?"


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    os.environ["TRITON_INTERPRET"] = "1"  # now only so that the launchers accept CPU tensors (nothing runs)
    seen: dict = {}
    for name in ("plan_kernel", "verify_kernel", "stamp_kernel"):
        setattr(launchers, name, Recorder(getattr(launchers, name), seen))
    tunings = (launchers.DEFAULT_TUNING, launchers.KernelTuning(verify_block=128, stamp_block=128, carry_block=128))
    for seed in range(n):
        case = gen.random_case(seed, corrupt=seed % 2 == 0)
        state = GroupState(case.group, case.records, case.ws, case.log)
        for tuning in tunings:
            launchers.plan_verify(state, case.batch, case.caps.verify_entries, tuning=tuning)
            launchers.plan(state, case.batch, tuning=tuning)
            launchers.verify(state, case.batch, case.caps.verify_entries, tuning=tuning)
            launchers.stamp(state, case.batch, tuning=tuning)
        ref.plan(state, case.batch)
    target = GPUTarget("cuda", 90, 32)
    failures = 0
    for (kname, _s, _c, warps), (sig, consts, _w) in sorted(seen.items(), key=lambda kv: str(kv[0])):
        fn = getattr(launchers, kname).fn
        os.environ.pop("TRITON_INTERPRET", None)
        try:
            compiled = triton.compile(ASTSource(fn, sig, consts), target=target, options={"num_warps": warps})
            regs = _registers(compiled.asm["cubin"])
            digest = hashlib.sha256(compiled.asm["cubin"]).hexdigest()[:16]
            print(f"ok   {kname} warps={warps} {dict(consts)} regs={regs} cubin={digest}", flush=True)
        except Exception as exc:
            failures += 1
            print(f"FAIL {kname} warps={warps} {dict(consts)}: {str(exc)[-600:]}", flush=True)
    print(f"triton {triton.__version__}, target sm_90: {len(seen)} variants, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
