# mypy: disable-error-code="no-untyped-def"
"""The same-step write checks on device (reference :mod:`kvcanary.ops.same_step`): verify's launch marks the
step's writes, stamp compares each write with the marks verify left (reads and writes of this step)."""

from __future__ import annotations

import triton
import triton.language as tl

from kvcanary.ops.kernels.codes import DUPLICATE, INTO_LIVE, NEW_READ_BAD, NOT_STORED, READER_BITS, READER_LIMIT
from kvcanary.ops.kernels.indexing import find_row, in_pool, is_reserved, pick, table_entry, translate


@triton.jit
def _write_row(item, w_row_ends, rb, wfirst_v, tbegin_v, tend_v, woff_ptr, witems_ptr, b,
               BLOCK_B: tl.constexpr, FUSED: tl.constexpr):  # fmt: skip
    """Stamp item ``item``'s row: (first item of the row, its tokens [begin, end))."""
    if FUSED:
        sel = rb == tl.zeros_like(rb) + tl.sum((w_row_ends <= item).to(tl.int64))
        first = pick(sel, wfirst_v)
        t_begin = pick(sel, tbegin_v)
        t_end = pick(sel, tend_v)
    else:
        r = find_row(witems_ptr, b, item, BLOCK_B)
        first = tl.load(witems_ptr + r)
        t_begin = tl.load(woff_ptr + r)
        t_end = tl.load(woff_ptr + r + 1)
    return first, t_begin, t_end


@triton.jit
def mark_writes(
    pid, n_programs, n_witems, b, loc_ptr, lookup_ptr, woff_ptr, witems_ptr, write_marks_ptr, n_tokens, n_lookup,
    num_slots, mark, positions_ptr, old_pos_ptr, window, res0, res1, res2, res3, res4, res5, res6, res7,
    w_row_ends, rb, wfirst_v, tbegin_v, tend_v,
    HAS_LOOKUP: tl.constexpr, STAMP_BLOCK: tl.constexpr, BLOCK_B: tl.constexpr, FUSED: tl.constexpr,
):  # fmt: skip
    """reference same_step.mark_step's writes: 2 * mark on every slot stored this step, + 1 when twice.

    The last of several writers to swap the mark in sees it already set and adds the 1 after its swap,
    so the bit survives whatever the order.  Window groups also keep the position each written slot holds
    now, before stamp overwrites it, for stamp's ring test.  Items are dealt from the last program down, so
    that a small step's writes and its verify items run on different programs.
    """
    for item in range(n_programs - 1 - pid, n_witems, n_programs):
        first, t_begin, t_end = _write_row(
            item, w_row_ends, rb, wfirst_v, tbegin_v, tend_v, woff_ptr, witems_ptr, b, BLOCK_B, FUSED
        )
        t = t_begin + (item - first) * STAMP_BLOCK + tl.arange(0, STAMP_BLOCK)
        m = t < tl.minimum(t_end, n_tokens)
        full = tl.load(loc_ptr + t, mask=m, other=NOT_STORED).to(tl.int64)
        stored = m & (full != NOT_STORED)
        slot, lookup_bad = translate(lookup_ptr, n_lookup, full, stored, HAS_LOOKUP)
        ok = stored & ~lookup_bad & in_pool(slot, num_slots)
        writable = ok & ~is_reserved(slot, res0, res1, res2, res3, res4, res5, res6, res7)
        old = tl.atomic_xchg(
            write_marks_ptr + slot, tl.zeros_like(slot).to(tl.int32) + 2 * mark, mask=writable, sem="relaxed"
        )
        twice = writable & ((old >> 1) == mark)
        tl.atomic_or(write_marks_ptr + slot, tl.zeros_like(slot).to(tl.int32) + 1, mask=twice, sem="relaxed")
        keep = writable & (tl.zeros_like(slot) + window > 0)
        tl.store(old_pos_ptr + t, tl.load(positions_ptr + slot, mask=keep, other=0), mask=keep)


@triton.jit
def same_step_reasons(
    slot, writable, t, exp_pos, pre, trow, batch_row, mark, step_epoch, read_marks_ptr, write_marks_ptr, old_pos_ptr,
    table_ptr, lookup_ptr,
    n_rows, n_cols, page, window, n_lookup, num_slots, res0, res1, res2, res3, res4, res5, res6, res7,
    PAGED: tl.constexpr, HAS_LOOKUP: tl.constexpr, CHECK_NEW: tl.constexpr,
):  # fmt: skip
    """reference same_step.write_reasons: the marks verify left, the ring exception, the new token's entry."""
    rmark = tl.load(read_marks_ptr + slot, mask=writable, other=0)
    live = writable & ((rmark >> READER_BITS) == step_epoch)
    reader = READER_LIMIT - 1 - (rmark & (READER_LIMIT - 1))
    # A window's ring: the slot held a position of the writer's own window that this token no longer sees.
    zero = tl.zeros_like(exp_pos)
    ring = live & (zero + window > 0)
    q = tl.load(old_pos_ptr + t, mask=ring, other=0).to(tl.int64)  # as verify saw it (see verify.py)
    ring = ring & (q >= zero + tl.maximum(pre - window, 0)) & (q < zero + pre) & (q < exp_pos - window)
    qfull = table_entry(table_ptr, trow, q, n_rows, n_cols, page, ring, PAGED)
    qslot, qbad = translate(lookup_ptr, n_lookup, qfull, ring, HAS_LOOKUP)
    live = live & ~(ring & ~qbad & in_pool(qslot, num_slots) & (qslot == slot))
    dup = writable & (tl.load(write_marks_ptr + slot, mask=writable, other=0).to(tl.int64) == 2 * mark + 1)
    reasons = tl.where(live, INTO_LIVE, 0) | tl.where(dup, DUPLICATE, 0)
    new_index = tl.zeros_like(slot) - 1
    if CHECK_NEW:
        nfull = table_entry(table_ptr, trow, exp_pos, n_rows, n_cols, page, writable, PAGED)
        nslot, nbad = translate(lookup_ptr, n_lookup, nfull, writable, HAS_LOOKUP)
        nres = ~nbad & in_pool(nslot, num_slots) & is_reserved(nslot, res0, res1, res2, res3, res4, res5, res6, res7)
        new_bad = writable & ~nres & (nslot != slot)
        reasons = reasons | tl.where(new_bad, NEW_READ_BAD, 0)
        new_index = tl.where(new_bad, nfull, new_index)
    # A live write's row names the request whose read it hits; BAD_INDEX the writing row (see same_step.py).
    return reasons, tl.where(live, zero + batch_row, new_index), tl.where(live, reader, zero + batch_row)
