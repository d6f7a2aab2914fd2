# mypy: disable-error-code="no-untyped-def"
"""Verify on device: programs walk work items (one block of one row's entries), reading the table directly.

Each item's row comes from the plan's item offsets; entries are the row's positions from its window
start, so table and predecessor loads are contiguous.  Entries past the capacity are skipped and
counted.  The last program to finish appends the first-K / last-K rows (see :mod:`.log`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvcanary.ops.kernels.const import const
from kvcanary.ops.kernels.hashing import LINK_ANCHOR, link_step
from kvcanary.ops.kernels.indexing import expected_token, find_row, in_pool, is_reserved, table_entry, translate
from kvcanary.ops.kernels.log import (
    CALLS,
    COUNTER_LANES,
    NO_ITEM,
    PENDING,
    SCAN,
    SKIPPED,
    VERIFIED,
    VIOLATIONS,
    add_counters,
    close_call,
    finish,
    next_item,
    reason_counts,
    select_items,
    store_rows,
)
from kvcanary.schema import NOT_STORED as _NOT_STORED
from kvcanary.schema import Phase, Reason
from kvcanary.workspace import PlanWorkspace

LINK_BAD = const(int(Reason.LINK_MISMATCH))
POSITION_BAD = const(int(Reason.POSITION_MISMATCH))
TOKEN_BAD = const(int(Reason.TOKEN_MISMATCH))
NEVER_WRITTEN = const(int(Reason.NEVER_WRITTEN))
RESERVED = const(int(Reason.RESERVED_SLOT))
SLOT_OOR = const(int(Reason.SLOT_OUT_OF_RANGE))
PRED_OOR = const(int(Reason.PREDECESSOR_OUT_OF_RANGE))
LOOKUP_OOR = const(int(Reason.LOOKUP_OUT_OF_RANGE))
PHASE = const(int(Phase.VERIFY))
FINAL_LANES = const(128)  # entries per sub-block when the finalize re-derives an item
NOT_STORED = const(_NOT_STORED)
MARK_PERIOD = const(PlanWorkspace.MARK_PERIOD)
READER_BITS = const(PlanWorkspace.READER_BITS)
READER_LIMIT = const(PlanWorkspace.READER_LIMIT)


@triton.jit
def _verify_item(
    item, sub, row_ends, rows_ptr, table_ptr, lookup_ptr, truth_ptr, truth_lens_ptr, tokens_ptr, positions_ptr,
    links_ptr, voff_ptr, starts_ptr, vitems_ptr,
    b, n_rows, n_cols, n_lookup, t_rows, t_cols, num_slots, n_verify, page, token_offset,
    res0, res1, res2, res3, res4, res5, res6, res7,
    PAGED: tl.constexpr, HAS_LOOKUP: tl.constexpr, HAS_TRUTH: tl.constexpr,
    BLOCK: tl.constexpr, LANES: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    """reference.verify for entries [sub * LANES, (sub + 1) * LANES) of one item: every output field, and
    the mask of real entries.  ``row_ends`` caches the item offsets of rows [1, BLOCK_B]."""
    if b <= BLOCK_B:
        r = tl.sum((row_ends <= item).to(tl.int64))
    else:
        r = find_row(vitems_ptr, b, item, BLOCK_B)
    chunk = item - tl.load(vitems_ptr + r)
    e_begin = tl.load(voff_ptr + r)
    e_end = tl.minimum(tl.load(voff_ptr + r + 1), n_verify)
    trow = tl.load(rows_ptr + r).to(tl.int64)
    local = chunk * BLOCK + sub * LANES + tl.arange(0, LANES)
    m = e_begin + local < e_end
    pos = tl.load(starts_ptr + r) + local

    full = table_entry(table_ptr, trow, pos, n_rows, n_cols, page, m, PAGED)
    slot, lookup_bad = translate(lookup_ptr, n_lookup, full, m, HAS_LOOKUP)
    lookup_bad = lookup_bad & m
    ok = m & ~lookup_bad & in_pool(slot, num_slots)
    slot_oor = m & ~lookup_bad & ~ok
    tok32 = tl.load(tokens_ptr + slot, mask=ok, other=0)
    pos32 = tl.load(positions_ptr + slot, mask=ok, other=0)
    stored_link = tl.load(links_ptr + slot, mask=ok, other=0)
    stored_tok = tok32.to(tl.int64)
    stored_pos = pos32.to(tl.int64)
    reserved = ok & is_reserved(slot, res0, res1, res2, res3, res4, res5, res6, res7)
    never = ok & ~reserved & (stored_link == 0)
    checked = ok & ~reserved & ~never

    exp_tok = expected_token(truth_ptr, truth_lens_ptr, r, trow, pos + token_offset, t_rows, t_cols, m, HAS_TRUTH)
    pos_bad = checked & (stored_pos != pos)
    tok_bad = checked & (exp_tok != -1) & (stored_tok != exp_tok)

    has_pred = pos > 0
    pm = m & has_pred
    pfull = table_entry(table_ptr, trow, pos - 1, n_rows, n_cols, page, pm, PAGED)
    pslot, plookup_raw = translate(lookup_ptr, n_lookup, pfull, pm, HAS_LOOKUP)
    pred_resolved = pm & ~plookup_raw
    plookup_bad = checked & pm & plookup_raw
    pred_in = in_pool(pslot, num_slots)
    pred_oor = checked & pred_resolved & ~pred_in
    pred_usable = pred_resolved & pred_in & ~is_reserved(pslot, res0, res1, res2, res3, res4, res5, res6, res7)
    link_checked = checked & (~has_pred | pred_usable)
    prev_link = tl.load(links_ptr + pslot, mask=link_checked & has_pred, other=0)
    prev_link = tl.where(has_pred, prev_link, LINK_ANCHOR)
    exp_link = tl.where(link_checked, link_step(prev_link, tok32, pos32), 0)
    link_bad = link_checked & (exp_link != stored_link)

    reasons = (
        tl.where(lookup_bad | plookup_bad, LOOKUP_OOR, 0)
        | tl.where(slot_oor, SLOT_OOR, 0)
        | tl.where(reserved, RESERVED, 0)
        | tl.where(never, NEVER_WRITTEN, 0)
        | tl.where(pos_bad, POSITION_BAD, 0)
        | tl.where(tok_bad, TOKEN_BAD, 0)
        | tl.where(link_bad, LINK_BAD, 0)
        | tl.where(pred_oor, PRED_OOR, 0)
    ).to(tl.int64)
    bad_index = tl.where(
        lookup_bad, full, tl.where(slot_oor, slot, tl.where(plookup_bad, pfull, tl.where(pred_oor, pslot, -1)))
    )
    pred = tl.where(pred_resolved, pslot, -1)
    live = ok & ~reserved  # a slot attention gathers this step
    return (
        r, trow, live, slot, pred, pos, stored_pos, exp_tok, stored_tok, exp_link, stored_link, bad_index, reasons
    )  # fmt: skip


@triton.jit
def _mark_writes(
    pid, n_programs, b, loc_ptr, lookup_ptr, woff_ptr, witems_ptr, write_marks_ptr, n_tokens, n_lookup, num_slots,
    mark, positions_ptr, old_pos_ptr, window, res0, res1, res2, res3, res4, res5, res6, res7,
    HAS_LOOKUP: tl.constexpr, STAMP_BLOCK: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    """reference same_step.mark_step's writes: 2 * mark on every slot stored this step, + 1 when twice.

    The last of several writers to swap the mark in sees it already set and adds the 1 after its swap,
    so the bit survives whatever the order.  Window groups also keep the position each written slot holds
    now, before stamp overwrites it, for stamp's ring test.
    """
    for item in range(pid, tl.load(witems_ptr + b), n_programs):
        r = find_row(witems_ptr, b, item, BLOCK_B)
        t = tl.load(woff_ptr + r) + (item - tl.load(witems_ptr + r)) * STAMP_BLOCK + tl.arange(0, STAMP_BLOCK)
        m = t < tl.minimum(tl.load(woff_ptr + r + 1), n_tokens)
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


# Integer arguments are not specialised: one compiled kernel serves every batch shape.
@triton.jit(
    do_not_specialize=[
        "b",
        "n_rows",
        "n_cols",
        "n_lookup",
        "t_rows",
        "t_cols",
        "num_slots",
        "capacity",
        "max_items",
        "log_k",
        "group_id",
        "page",
        "token_offset",
        "res0",
        "res1",
        "res2",
        "res3",
        "res4",
        "res5",
        "res6",
        "res7",
        "n_tokens",
        "window",
    ]
)
def verify_kernel(
    rows_ptr, table_ptr, lookup_ptr, truth_ptr, truth_lens_ptr, tokens_ptr, positions_ptr, links_ptr,
    voff_ptr, starts_ptr, vitems_ptr, counts_ptr, sync_ptr, first_ptr, last_ptr, counters_ptr,
    loc_ptr, woff_ptr, witems_ptr, epoch_ptr, read_marks_ptr, write_marks_ptr, old_pos_ptr,
    b, n_rows, n_cols, n_lookup, t_rows, t_cols, num_slots, capacity, max_items, log_k, group_id, page, token_offset,
    res0, res1, res2, res3, res4, res5, res6, res7, n_tokens, window,
    PAGED: tl.constexpr, HAS_LOOKUP: tl.constexpr, HAS_TRUTH: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_B: tl.constexpr, STAMP_BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    step_epoch = tl.load(epoch_ptr)
    mark = (1 + step_epoch % MARK_PERIOD).to(tl.int32)
    read_base = step_epoch << READER_BITS
    planned = tl.load(voff_ptr + b)
    rb = tl.arange(0, BLOCK_B)
    row_ends = tl.load(vitems_ptr + 1 + rb, mask=rb < b, other=NO_ITEM)
    n_verify = tl.maximum(tl.minimum(planned, capacity), 0)
    # Items starting below the capacity: at most one per row beyond ceil(n / BLOCK) (the scratch bound).
    n_items = tl.minimum(tl.minimum(tl.load(vitems_ptr + b), (n_verify + BLOCK - 1) // BLOCK + b), max_items)

    found = tl.zeros((), tl.int64)
    bits = tl.zeros((COUNTER_LANES,), tl.int64)
    for item in range(pid, n_items, n_programs):
        _r, _trow, live, slot, _pred, _pos, _spos, _etok, _stok, _elink, _slink, _bad, reasons = _verify_item(
            item, 0, row_ends, rows_ptr, table_ptr, lookup_ptr, truth_ptr, truth_lens_ptr, tokens_ptr,
            positions_ptr, links_ptr, voff_ptr, starts_ptr, vitems_ptr, b, n_rows, n_cols, n_lookup, t_rows, t_cols,
            num_slots, n_verify, page, token_offset, res0, res1, res2, res3, res4, res5, res6, res7,
            PAGED, HAS_LOOKUP, HAS_TRUTH, BLOCK, BLOCK, BLOCK_B,
        )  # fmt: skip
        # 8 bytes an entry; the largest value is the current step's lowest reader row.
        # Relaxed: only the kernel boundary orders these against stamp's loads.
        tl.atomic_max(
            read_marks_ptr + slot, tl.zeros_like(slot) + read_base + (READER_LIMIT - 1 - _r), mask=live, sem="relaxed"
        )
        n_hit = tl.sum((reasons != 0).to(tl.int32))
        if n_hit > 0:  # clean items leave their count at 0
            tl.atomic_xchg(counts_ptr + item, n_hit)
            bits += reason_counts(reasons)
            found += n_hit
    _mark_writes(
        pid, n_programs, b, loc_ptr, lookup_ptr, woff_ptr, witems_ptr, write_marks_ptr, n_tokens, n_lookup, num_slots,
        mark, positions_ptr, old_pos_ptr, window, res0, res1, res2, res3, res4, res5, res6, res7,
        HAS_LOOKUP, STAMP_BLOCK, BLOCK_B,
    )  # fmt: skip
    if found > 0:
        tl.atomic_add(sync_ptr + PENDING, found)
        add_counters(counters_ptr, bits)

    ticket = finish(sync_ptr, counters_ptr, pid, VERIFIED, n_verify, SKIPPED, planned - n_verify, CALLS, 1, False)
    if ticket == n_programs - 1:
        total = close_call(sync_ptr)
        if total > 0:
            base = tl.atomic_add(counters_ptr + VIOLATIONS, total)
            prefix = tl.zeros((), tl.int64)
            for c0 in range(0, n_items, SCAN):
                idx, excl, want, prefix = select_items(counts_ptr, c0, n_items, prefix, base, total, log_k)
                for _ in range(tl.sum(want.to(tl.int32))):
                    j, rank = next_item(idx, excl, want)
                    # Re-derive the item in narrow sub-blocks: this rare path must not raise the
                    # kernel's register count.
                    for sub in range(BLOCK // FINAL_LANES):
                        r, trow, _m, slot, pred, pos, spos, etok, stok, elink, slink, bad, reasons = _verify_item(
                            j, sub, row_ends, rows_ptr, table_ptr, lookup_ptr, truth_ptr, truth_lens_ptr, tokens_ptr,
                            positions_ptr, links_ptr, voff_ptr, starts_ptr, vitems_ptr, b, n_rows, n_cols, n_lookup,
                            t_rows, t_cols, num_slots, n_verify, page, token_offset,
                            res0, res1, res2, res3, res4, res5, res6, res7,
                            PAGED, HAS_LOOKUP, HAS_TRUTH, BLOCK, FINAL_LANES, BLOCK_B,
                        )  # fmt: skip
                        hit = reasons != 0
                        hit64 = hit.to(tl.int64)
                        g = base + rank + tl.cumsum(hit64, 0) - hit64
                        store_rows(
                            first_ptr, last_ptr, log_k, g, base + total, hit, reasons, PHASE, group_id, r, trow,
                            slot, pred, pos, spos, etok, stok, elink, slink, bad,
                        )  # fmt: skip
                        rank += tl.sum(hit64)
                    want = want & (idx != j)
