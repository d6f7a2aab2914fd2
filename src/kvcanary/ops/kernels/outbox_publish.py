# mypy: disable-error-code="no-untyped-def"
"""The outbox published into host memory by the step's own device work (its spec: :func:`kvcanary.runtime.publish.
publish_reference`).

Each host step used to copy the outbox into one of three pinned host buffers and record an event behind the copy,
then query an earlier step's event: three CUDA calls a step, each costing microseconds of host time with the CPU
caches cold. This kernel, the last of the step's work (inside the canary's step graph on CUDA), writes the outbox
into buffer ``seq % NUM_BUFFERS`` of a pinned block the device reaches directly, then sets that buffer's flag to
``seq + 1`` behind a system-scope release, and counts ``seq`` on: the host reads the flag, plain memory, to know the
copy landed.

``state`` is ``[seq, ticket]`` in device memory.  Every program reads ``seq`` first, copies its block, then takes a
ticket with a system-scope acquire-release atomic (on device memory), which makes its writes visible to the CPU
first; the program that takes the last ticket has acquired every other program's, so it resets the ticket, moves
``seq`` on and stores the flag last.  ``seq`` changes only after every program has read it.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["size"])
def outbox_publish_kernel(outbox_ptr, host_ptr, flags_ptr, state_ptr, size, NUM_BUFFERS: tl.constexpr,
                          BLOCK: tl.constexpr):  # fmt: skip
    seq = tl.load(state_ptr)
    slot = seq % NUM_BUFFERS
    i = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    m = i < size
    tl.store(host_ptr + slot * size + i, tl.load(outbox_ptr + i, mask=m, other=0), mask=m)
    tl.debug_barrier()  # every thread's writes before the program's ticket
    # System scope: the program's writes to host memory are visible to the CPU before its ticket is (device memory:
    # a GPU over PCIe makes no atomic on host memory, so the flag below is a plain store, ordered by this).
    ticket = tl.atomic_add(state_ptr + 1, 1, sem="acq_rel", scope="sys")
    if ticket == tl.num_programs(0) - 1:  # every program's ticket acquired: every program's writes visible
        tl.store(state_ptr + 1, 0)
        tl.store(state_ptr, seq + 1)
        tl.store(flags_ptr + slot, seq + 1)
