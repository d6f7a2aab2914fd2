# mypy: disable-error-code="no-untyped-def"
"""The end of the manager's step on device, as one launch (its spec: the torch ops of ``StepWork.after`` on CPU).

The step's live log and counters are copied into the outbox's snapshot, the counters are added to the
outbox's running totals, the live log is cleared for the next step and the after-forward phase mark is bumped.
As four torch ops that was four nodes of every captured step, and in a replayed graph each small node costs
its launch gap as well as its work (benchmarks/README.md: the canary's graph, node by node).  Every program
owns one block of ``live`` and touches only its own words, so no program waits for another.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["live_size", "counters_offset", "totals_offset", "phase_after"])
def step_close_kernel(live_ptr, outbox_ptr, live_size, counters_offset, totals_offset, phase_after,
                      BLOCK: tl.constexpr):  # fmt: skip
    i = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    m = i < live_size
    value = tl.load(live_ptr + i, mask=m, other=0)
    tl.store(outbox_ptr + i, value, mask=m)  # the snapshot: the outbox's first live_size words
    counter = m & (i >= counters_offset)
    total_at = outbox_ptr + totals_offset + (i - counters_offset)
    tl.store(total_at, tl.load(total_at, mask=counter, other=0) + value, mask=counter)
    tl.store(live_ptr + i, tl.zeros_like(value), mask=m)
    if tl.program_id(0) == 0:
        tl.store(outbox_ptr + phase_after, tl.load(outbox_ptr + phase_after) + 1)
