"""Compile the canary's kernels for sm_90 on a machine without a GPU (Triton's front end, LLVM and ptxas).

The link kernels (plan, verify, stamp) and the KV digest kernel, every variant the launchers reach.

The interpreter runs kernels as Python and accepts code the compiler refuses (a loop-carried variable whose
type changes, say); this catches that before device time is spent.  The kernels' arguments come from the
launchers themselves, run on CPU tensors with the kernels swapped for recorders, over the differential
test's random cases and, for the digest, every layout and dtype of ``tests/digest_cases.py`` through the list
calls and a planned verify (so every combination of static flags that they reach is compiled).  Each variant's line
ends with a hash of its machine code (SASS, without the line info the cubin also carries): two source
trees whose lines match compile to the same machine code.
Usage: PYTHONPATH=src:tests python scripts/gpu/compile_offline.py [cases]
"""

from __future__ import annotations

import hashlib
import os
import random
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

import digest_cases as dc
import gen
from kvcanary import CanaryGroup
from kvcanary import digest as D
from kvcanary.ops import digest_launchers as dl
from kvcanary.ops import launchers
from kvcanary.ops import reference as ref
from kvcanary.workspace import GroupState, ViolationLog

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
            maxnreg = kwargs.pop("maxnreg", None)  # a compile option (KernelTuning.verify_maxnreg), not a parameter
            for name, value in kwargs.items():
                sig[name] = "constexpr"
                consts[(names.index(name),)] = value
            key = (self.fn.__name__, tuple(sorted(sig.items())), tuple(sorted(consts.items())), warps, maxnreg)
            self.seen.setdefault(key, (sig, consts, warps, maxnreg))

        return launch


def _cuobjdump(cubin: bytes, flag: str) -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), flag, f.name], capture_output=True, text=True).stdout


def _sass_hash(cubin: bytes) -> str:
    """A hash of the machine code alone: the cubin's bytes also carry line info, which moves with the source."""
    code = [line.split(";")[0].strip() for line in _cuobjdump(cubin, "-sass").splitlines() if "/*0" in line]
    return hashlib.sha256("\n".join(code).encode()).hexdigest()[:16]


def _registers(cubin: bytes) -> str:
    """Registers per thread and spill stores, from the cuobjdump that ships with Triton."""
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", _cuobjdump(cubin, "-res-usage"))
    return f"{m.group(1)} (stack {m.group(2)})" if m else "?"


def record_digest(seen: dict) -> None:
    """The digest kernel's launches: each layout and dtype as stamp and verify lists (small and large,
    with and without a lookup), and a planned verify (alone and fused with the stamp) over paged and token-major
    pools."""
    dl.digest_kernel = Recorder(dl.digest_kernel, seen)
    rng = random.Random(0)
    for kind in dc.LAYOUTS:
        for dtype in dc.DTYPES:
            bs = 1 if kind == "token_major" else 16
            for heads, dim in ((8, 128), (2, 5)):
                layout = D.DigestLayout(tuple(dc.layer_components(kind, 8, bs, heads, dim, dtype, torch.Generator())))
                _digest_lists(layout, rng)
    for page, kind in ((1, "token_major"), (16, "paged")):
        group, batch, plan_ws = dc.planned_step(16 * 24, [0, 17, 45, 100], page=page)
        comps = dc.layer_components(kind, 16 * 24 // page, page, 8, 128, torch.bfloat16, torch.Generator())
        layout = dl.DeviceLayout.build(D.DigestLayout(tuple(comps)))
        digests, ws, log = _digest_state(group.num_slots, 256)
        for tuning in (dl.DEFAULT_TUNING, dl.DigestTuning(block_words=128)):
            dl.verify_planned(group, layout, digests, ws, log, batch, plan_ws, period=3, tuning=tuning)
            dl.verify_and_stamp(group, layout, digests, ws, log, batch, plan_ws, period=3, tuning=tuning)


def _digest_state(slots: int, entries: int) -> tuple[torch.Tensor, D.DigestWorkspace, ViolationLog]:
    return torch.zeros(slots, dtype=torch.int64), D.DigestWorkspace.allocate(entries), ViolationLog.allocate(4)


def _digest_lists(layout: D.DigestLayout, rng: random.Random) -> None:
    group = CanaryGroup(num_slots=layout.num_slots, reserved_slots=())
    dev_layout = dl.DeviceLayout.build(layout)
    digests, ws, log = _digest_state(layout.num_slots, 128)
    lookup = torch.randperm(layout.num_slots)
    for n in (1, 100):
        locs = torch.tensor([rng.randrange(layout.num_slots) for _ in range(n)])
        dl.stamp_list(group, dev_layout, digests, ws, log, locs)
        dl.verify_list(group, dev_layout, digests, ws, log, locs, lookup=lookup, report_range=True)


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    os.environ["TRITON_INTERPRET"] = "1"  # now only so that the launchers accept CPU tensors (nothing runs)
    seen: dict = {}
    for name in ("plan_kernel", "verify_kernel", "stamp_kernel"):
        setattr(launchers, name, Recorder(getattr(launchers, name), seen))
    record_digest(seen)
    tunings = (
        launchers.DEFAULT_TUNING,
        launchers.KernelTuning(verify_block=128, stamp_block=128, carry_block=128),
        launchers.KernelTuning(verify_maxnreg=64, programs_per_sm=8),
    )
    mark = torch.zeros(1, dtype=torch.int64)
    for seed in range(n):
        case = gen.random_case(seed, corrupt=seed % 2 == 0)
        state = GroupState(case.group, case.records, case.ws, case.log)
        for tuning in tunings:
            launchers.plan_verify(state, case.batch, case.caps.verify_entries, tuning=tuning)
            # The runtime's first group also counts the phase mark in its first launch.
            launchers.plan_verify(state, case.batch, case.caps.verify_entries, tuning=tuning, mark=mark)
            launchers.plan(state, case.batch, tuning=tuning)
            launchers.verify(state, case.batch, case.caps.verify_entries, tuning=tuning)
            launchers.stamp(state, case.batch, tuning=tuning)
        ref.plan(state, case.batch)
    target = GPUTarget("cuda", 90, 32)
    failures = 0
    for (kname, _s, _c, warps, _m), (sig, consts, _w, maxnreg) in sorted(seen.items(), key=lambda kv: str(kv[0])):
        fn = (dl if kname == "digest_kernel" else launchers).__dict__[kname].fn
        os.environ.pop("TRITON_INTERPRET", None)
        options = {"num_warps": warps} if maxnreg is None else {"num_warps": warps, "maxnreg": maxnreg}
        try:
            compiled = triton.compile(ASTSource(fn, sig, consts), target=target, options=options)
            regs = _registers(compiled.asm["cubin"])
            sass = _sass_hash(compiled.asm["cubin"])
            print(f"ok   {kname} warps={warps} maxnreg={maxnreg} {dict(consts)} regs={regs} sass={sass}", flush=True)
        except Exception as exc:
            failures += 1
            print(f"FAIL {kname} warps={warps} maxnreg={maxnreg} {dict(consts)}: {str(exc)[-600:]}", flush=True)
    print(f"triton {triton.__version__}, target sm_90: {len(seen)} variants, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
