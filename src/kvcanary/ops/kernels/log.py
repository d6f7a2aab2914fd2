# mypy: disable-error-code="no-untyped-def"
"""The violation log on device: deterministic row placement, reason counts and the per-call finalize.

Row i of a log's lifetime lands in ``first[i]`` when i < K and in ``last[i % K]`` when it is among the
last K rows of its call; a row's index is fixed by its rank (plan rows by batch row, verify rows by
entry, stamp rows by token), never by atomic arrival order.  Multi-program kernels count violations
per item, the last program to finish (a ticket) learns the call's total and base, then re-derives and
writes only the items that hold first-K or last-K rows.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvcanary.ops.kernels.const import const
from kvcanary.schema import NUM_COUNTERS, NUM_REASONS, ROW_WIDTH, Counter, Field

N_REASONS = const(NUM_REASONS)
N_COUNTERS = const(NUM_COUNTERS)
WIDTH = const(ROW_WIDTH)
VIOLATIONS = const(int(Counter.VIOLATIONS))
VERIFIED = const(int(Counter.VERIFIED))
SKIPPED = const(int(Counter.SKIPPED))
STAMPED = const(int(Counter.STAMPED))
CALLS = const(int(Counter.CALLS))
F_REASONS = const(int(Field.REASONS))
F_PHASE = const(int(Field.PHASE))
F_GROUP = const(int(Field.GROUP))
F_BATCH_ROW = const(int(Field.BATCH_ROW))
F_TABLE_ROW = const(int(Field.TABLE_ROW))
F_SLOT = const(int(Field.SLOT))
F_PRED = const(int(Field.PRED))
F_EXPECTED_POSITION = const(int(Field.EXPECTED_POSITION))
F_STORED_POSITION = const(int(Field.STORED_POSITION))
F_EXPECTED_TOKEN = const(int(Field.EXPECTED_TOKEN))
F_STORED_TOKEN = const(int(Field.STORED_TOKEN))
F_EXPECTED_LINK = const(int(Field.EXPECTED_LINK))
F_STORED_LINK = const(int(Field.STORED_LINK))
F_BAD_INDEX = const(int(Field.BAD_INDEX))

# Per-phase words of the workspace's sync scratch: violations pending (summed by all programs), finished
# programs (the ticket), (stamp) the call's epoch, and (verify) the pending violations of a plan folded in.
# Pending and ticket are back to 0 when a call ends.
PENDING = const(0)
TICKET = const(1)
EPOCH = const(2)
PLAN_PENDING = const(3)  # verify's words only: the plan's violations when the plan runs in the verify launch
SCAN = const(1024)  # items the finalize scans per step
NO_ITEM = const(2**62)
COUNTER_LANES = const(32)  # >= NUM_COUNTERS


@triton.jit
def reason_counts(reasons):
    """Per-bit counts of ``reasons`` as a [COUNTER_LANES] int64 vector, lane i = counters[i]."""
    k = tl.arange(0, COUNTER_LANES)
    acc = tl.zeros((COUNTER_LANES,), tl.int64)
    for j in tl.static_range(N_REASONS):
        acc += tl.where(k == j, tl.sum(((reasons >> j) & 1).to(tl.int64)), 0)
    return acc


@triton.jit
def add_counters(counters_ptr, counts):
    """counters[i] += counts[i] for the non-zero lanes (one vector atomic); returns the old values."""
    k = tl.arange(0, COUNTER_LANES)
    return tl.atomic_add(counters_ptr + k, counts, mask=(k < N_COUNTERS) & (counts != 0))


@triton.jit
def lane(values, i):
    """Element ``i`` of a small vector, as a scalar."""
    return tl.sum(tl.where(tl.arange(0, values.shape[0]) == i, values, 0))


@triton.jit
def finish(sync_ptr, counters_ptr, pid, c1, v1, c2, v2, c3, v3, ALL3: tl.constexpr):
    """Take this program's ticket and add to three counters in one vector atomic (one round trip).

    ``counters[c1] += v1`` and ``counters[c2] += v2`` come from program 0 only; ``counters[c3] += v3``
    from every program when ALL3, else from program 0.  Returns the ticket (programs finished before).
    """
    k = tl.arange(0, 4)
    first = tl.zeros_like(k) + pid == 0  # widened before comparing (interpreter, see indexing.py)
    idx = tl.where(k == 1, c1, tl.where(k == 2, c2, c3))
    ptrs = tl.where(k == 0, sync_ptr + TICKET, counters_ptr + idx)
    vals = tl.where(k == 0, 1, tl.where(k == 1, v1, tl.where(k == 2, v2, v3))).to(tl.int64)
    mine = first | ((k == 3) & ALL3)
    old = tl.atomic_add(ptrs, vals, mask=(k == 0) | (mine & (vals != 0)))
    return lane(old, 0)


@triton.jit
def close_call(sync_ptr):
    """Last program: read the call's pending violations and zero pending and ticket for the next call."""
    k = tl.arange(0, 2)
    old = tl.atomic_xchg(sync_ptr + k, tl.zeros((2,), tl.int64))
    return lane(old, PENDING)


@triton.jit
def close_fused_call(sync_ptr):
    """close_call for a launch that also ran the plan: (pending violations, the plan's pending violations);
    PLAN_PENDING is zeroed too."""
    k = tl.arange(0, 4)
    old = tl.atomic_xchg(sync_ptr + k, tl.zeros((4,), tl.int64), mask=k != EPOCH)
    return lane(old, PENDING), lane(old, PLAN_PENDING)


@triton.jit
def _store_fields(
    ptr,
    mask,
    reasons,
    phase,
    group,
    batch_row,
    table_row,
    slot,
    pred,
    exp_pos,
    st_pos,
    exp_tok,
    st_tok,
    exp_link,
    st_link,
    bad_index,
):
    zero = tl.zeros_like(reasons)
    tl.store(ptr + F_REASONS, reasons, mask=mask)
    tl.store(ptr + F_PHASE, zero + phase, mask=mask)
    tl.store(ptr + F_GROUP, zero + group, mask=mask)
    tl.store(ptr + F_BATCH_ROW, zero + batch_row, mask=mask)
    tl.store(ptr + F_TABLE_ROW, zero + table_row, mask=mask)
    tl.store(ptr + F_SLOT, zero + slot, mask=mask)
    tl.store(ptr + F_PRED, zero + pred, mask=mask)
    tl.store(ptr + F_EXPECTED_POSITION, zero + exp_pos, mask=mask)
    tl.store(ptr + F_STORED_POSITION, zero + st_pos, mask=mask)
    tl.store(ptr + F_EXPECTED_TOKEN, zero + exp_tok, mask=mask)
    tl.store(ptr + F_STORED_TOKEN, zero + st_tok, mask=mask)
    tl.store(ptr + F_EXPECTED_LINK, zero + exp_link, mask=mask)
    tl.store(ptr + F_STORED_LINK, zero + st_link, mask=mask)
    tl.store(ptr + F_BAD_INDEX, zero + bad_index, mask=mask)


@triton.jit
def store_rows(
    first_ptr,
    last_ptr,
    log_k,
    g,
    end,
    hit,
    reasons,
    phase,
    group,
    batch_row,
    table_row,
    slot,
    pred,
    exp_pos,
    st_pos,
    exp_tok,
    st_tok,
    exp_link,
    st_link,
    bad_index,
):
    """Write the rows where ``hit``: lifetime index ``g``; the call's rows end at ``end`` (exclusive)."""
    head = hit & (g < log_k)
    tail = hit & (g >= end - log_k)
    _store_fields(
        first_ptr + g * WIDTH, head, reasons, phase, group, batch_row, table_row, slot, pred,
        exp_pos, st_pos, exp_tok, st_tok, exp_link, st_link, bad_index,
    )  # fmt: skip
    _store_fields(
        last_ptr + (g % log_k) * WIDTH, tail, reasons, phase, group, batch_row, table_row, slot, pred,
        exp_pos, st_pos, exp_tok, st_tok, exp_link, st_link, bad_index,
    )  # fmt: skip


@triton.jit
def select_items(counts_ptr, c0, n_items, prefix, base, total, log_k):
    """Items [c0, c0+SCAN) that hold a first-K or last-K row of this call.

    Returns (item ids, exclusive rank of each item's first row within the call, wanted mask, prefix
    after the chunk).  Counts are read with atomics (other programs wrote them in this launch) and
    zeroed: only items with violations write a count, so clean calls never touch them.
    """
    idx = c0 + tl.arange(0, SCAN)
    mk = idx < n_items
    cnt = tl.atomic_xchg(counts_ptr + idx, tl.zeros((SCAN,), tl.int32), mask=mk)
    cnt = tl.where(mk, cnt, 0).to(tl.int64)
    incl = prefix + tl.cumsum(cnt, 0)
    excl = incl - cnt
    want = (cnt > 0) & ((base + excl < log_k) | (incl > total - log_k))
    return idx.to(tl.int64), excl, want, prefix + tl.sum(cnt)


@triton.jit
def next_item(idx, excl, want):
    """The lowest wanted item and its exclusive rank."""
    j = tl.min(tl.where(want, idx, NO_ITEM))
    return j, tl.sum(tl.where(idx == j, excl, 0))
