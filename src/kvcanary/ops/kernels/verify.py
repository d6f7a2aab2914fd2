# mypy: disable-error-code="no-untyped-def"
"""Verify on device: programs walk work items (one block of one row's entries), reading the table directly.

Each item's row comes from the plan's item offsets; entries are the row's positions from its window
start, so table and predecessor loads are contiguous.  Entries past the capacity are skipped and
counted.  The last program to finish appends the first-K / last-K rows (see :mod:`.log`).

With ``FUSED`` the launch is plan + verify: every program derives the batch rows' spans and item
offsets in registers (one coalesced load of the lengths: the batch fits one row block), the last
program of the grid also resolves the seeds and writes the plan's workspace rows for stamp and the
digest, and the finalize logs the plan's rows before verify's, as two calls in a row would.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvcanary.ops.kernels.codes import (
    LINK_BAD,
    LOOKUP_OOR,
    MARK_PERIOD,
    NEVER_WRITTEN,
    PHASE_VERIFY,
    POSITION_BAD,
    PRED_OOR,
    READER_BITS,
    READER_LIMIT,
    RESERVED,
    SLOT_OOR,
    TOKEN_BAD,
)
from kvcanary.ops.kernels.const import const
from kvcanary.ops.kernels.hashing import LINK_ANCHOR, link_step
from kvcanary.ops.kernels.indexing import (
    expected_token,
    find_row,
    in_pool,
    is_reserved,
    pick,
    table_entry,
    translate,
)
from kvcanary.ops.kernels.log import (
    CALLS,
    COUNTER_LANES,
    NO_ITEM,
    PENDING,
    PLAN_PENDING,
    SCAN,
    SKIPPED,
    VERIFIED,
    VIOLATIONS,
    add_counters,
    close_call,
    close_fused_call,
    finish,
    next_item,
    reason_counts,
    select_items,
    store_rows,
)
from kvcanary.ops.kernels.marks import mark_writes
from kvcanary.ops.kernels.plan import log_plan_rows, row_spans, store_plan

FINAL_LANES = const(128)  # entries per sub-block when the finalize re-derives an item


@triton.jit
def _verify_row(
    item, row_ends, rb, first_v, begin_v, end_v, rows_v, starts_v, rows_ptr, voff_ptr, starts_ptr, vitems_ptr,
    b, n_verify, BLOCK_B: tl.constexpr, FUSED: tl.constexpr,
):  # fmt: skip
    """Verify item ``item``'s row and its fields: (row, chunk within the row, entries [begin, end) capped at
    n_verify, table row, window start).  FUSED: from the launch's row vectors; else from the plan's workspace,
    where ``row_ends`` caches the item offsets of rows [1, BLOCK_B]."""
    if FUSED:
        r = tl.sum((row_ends <= item).to(tl.int64))
        sel = rb == tl.zeros_like(rb) + r  # widened before comparing (interpreter, see indexing.py)
        first = pick(sel, first_v)
        e_begin = pick(sel, begin_v)
        e_end = pick(sel, end_v)
        trow = pick(sel, rows_v)
        start = pick(sel, starts_v)
    else:
        if b <= BLOCK_B:
            r = tl.sum((row_ends <= item).to(tl.int64))
        else:
            r = find_row(vitems_ptr, b, item, BLOCK_B)
        first = tl.load(vitems_ptr + r)
        e_begin = tl.load(voff_ptr + r)
        e_end = tl.load(voff_ptr + r + 1)
        trow = tl.load(rows_ptr + r).to(tl.int64)
        start = tl.load(starts_ptr + r)
    return r, item - first, e_begin, tl.minimum(e_end, n_verify), trow, start


@triton.jit
def _verify_item(
    r, chunk, e_begin, e_end, trow, start, sub, table_ptr, lookup_ptr, truth_ptr, truth_lens_ptr, tokens_ptr,
    positions_ptr, links_ptr, n_rows, n_cols, n_lookup, t_rows, t_cols, num_slots, page, token_offset,
    res0, res1, res2, res3, res4, res5, res6, res7,
    PAGED: tl.constexpr, HAS_LOOKUP: tl.constexpr, HAS_TRUTH: tl.constexpr, BLOCK: tl.constexpr, LANES: tl.constexpr,
):  # fmt: skip
    """reference.verify for entries [sub * LANES, (sub + 1) * LANES) of one item (see _verify_row): every
    output field, and the mask of real entries."""
    local = chunk * BLOCK + sub * LANES + tl.arange(0, LANES)
    m = e_begin + local < e_end
    pos = start + local
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
    return trow, live, slot, pred, pos, stored_pos, exp_tok, stored_tok, exp_link, stored_link, bad_index, reasons


# Integer arguments are not specialised: one compiled kernel serves every batch shape.
@triton.jit(
    do_not_specialize=[
        "b", "n_rows", "n_cols", "n_lookup", "t_rows", "t_cols", "num_slots", "capacity", "max_items", "log_k",
        "group_id", "page", "token_offset", "res0", "res1", "res2", "res3", "res4", "res5", "res6", "res7",
        "n_tokens", "window", "width", "has_pad", "pad_row",
    ]
)  # fmt: skip
def verify_kernel(
    rows_ptr, table_ptr, lookup_ptr, truth_ptr, truth_lens_ptr, tokens_ptr, positions_ptr, links_ptr,
    voff_ptr, starts_ptr, vitems_ptr, counts_ptr, sync_ptr, first_ptr, last_ptr, counters_ptr,
    loc_ptr, woff_ptr, witems_ptr, epoch_ptr, read_marks_ptr, write_marks_ptr, old_pos_ptr,
    pre_ptr, ext_ptr, seeds_ptr, state_ptr, phase_mark_ptr,
    b, n_rows, n_cols, n_lookup, t_rows, t_cols, num_slots, capacity, max_items, log_k, group_id, page, token_offset,
    res0, res1, res2, res3, res4, res5, res6, res7, n_tokens, window, width, has_pad, pad_row,
    PAGED: tl.constexpr, HAS_LOOKUP: tl.constexpr, HAS_TRUTH: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_B: tl.constexpr, STAMP_BLOCK: tl.constexpr, FUSED: tl.constexpr,
    HAS_PHASE_MARK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    rb = tl.arange(0, BLOCK_B)
    found = tl.zeros((), tl.int64)
    plan_found = tl.zeros((), tl.int64)
    bits = tl.zeros((COUNTER_LANES,), tl.int64)
    if FUSED:
        step_epoch = tl.load(epoch_ptr) + 1  # plan's bump: the last program stores it
        r_v, m_v, rows_v, pre_v, ext_v, ext_sat, active, write_end, starts_v, counts_v, state_v, row_bad, len_bad = (
            row_spans(
                rows_ptr, pre_ptr, ext_ptr, 0, b, tl.zeros((), tl.int64), n_rows, width, n_tokens, window, has_pad,
                pad_row, BLOCK_B,
            )
        )  # fmt: skip
        verify_end = tl.cumsum(counts_v, 0)
        vitems_v = (counts_v + BLOCK - 1) // BLOCK
        vitem_end = tl.cumsum(vitems_v, 0)
        witems_v = tl.where(active, (ext_v + STAMP_BLOCK - 1) // STAMP_BLOCK, 0)
        witem_end = tl.cumsum(witems_v, 0)
        planned = tl.sum(counts_v)
        n_vitems = tl.sum(vitems_v)
        n_witems = tl.sum(witems_v)
        row_ends = tl.where(m_v, vitem_end, NO_ITEM)
        w_row_ends = tl.where(m_v, witem_end, NO_ITEM)
        if pid == n_programs - 1:  # a program that verifies nothing in a small step
            plan_reasons = store_plan(
                table_ptr, lookup_ptr, links_ptr, woff_ptr, voff_ptr, starts_ptr, seeds_ptr, state_ptr,
                vitems_ptr, witems_ptr, r_v, m_v, rows_v, pre_v, ext_v, active, row_bad, len_bad, write_end,
                verify_end, vitem_end, witem_end, starts_v, state_v, n_rows, n_cols, n_lookup, num_slots, page,
                res0, res1, res2, res3, res4, res5, res6, res7, PAGED, HAS_LOOKUP,
            )  # fmt: skip
            plan_found = tl.sum((plan_reasons != 0).to(tl.int64))
            if plan_found > 0:
                bits += reason_counts(plan_reasons)
                tl.atomic_add(sync_ptr + PLAN_PENDING, plan_found)
        first_v = vitem_end - vitems_v
        begin_v = verify_end - counts_v
        wfirst_v = witem_end - witems_v
        tbegin_v = write_end - ext_sat
        n_calls = 2
    else:
        step_epoch = tl.load(epoch_ptr)
        planned = tl.load(voff_ptr + b)
        n_vitems = tl.load(vitems_ptr + b)
        n_witems = tl.load(witems_ptr + b)
        row_ends = tl.load(vitems_ptr + 1 + rb, mask=rb < b, other=NO_ITEM)
        # Unused stand-ins for the row vectors of the fused form.
        w_row_ends = row_ends
        first_v = row_ends
        begin_v = row_ends
        verify_end = row_ends
        rows_v = row_ends
        starts_v = row_ends
        wfirst_v = row_ends
        tbegin_v = row_ends
        write_end = row_ends
        n_calls = 1
    mark = (1 + step_epoch % MARK_PERIOD).to(tl.int32)
    read_base = step_epoch << READER_BITS
    n_verify = tl.maximum(tl.minimum(planned, capacity), 0)
    # Items starting below the capacity: at most one per row beyond ceil(n / BLOCK) (the scratch bound).
    n_items = tl.minimum(tl.minimum(n_vitems, (n_verify + BLOCK - 1) // BLOCK + b), max_items)

    for item in range(pid, n_items, n_programs):
        r, chunk, e_begin, e_end, trow, start = _verify_row(
            item, row_ends, rb, first_v, begin_v, verify_end, rows_v, starts_v, rows_ptr, voff_ptr, starts_ptr,
            vitems_ptr, b, n_verify, BLOCK_B, FUSED,
        )  # fmt: skip
        _trow, live, slot, _pred, _pos, _spos, _etok, _stok, _elink, _slink, _bad, reasons = _verify_item(
            r, chunk, e_begin, e_end, trow, start, 0, table_ptr, lookup_ptr, truth_ptr, truth_lens_ptr, tokens_ptr,
            positions_ptr, links_ptr, n_rows, n_cols, n_lookup, t_rows, t_cols, num_slots, page, token_offset,
            res0, res1, res2, res3, res4, res5, res6, res7, PAGED, HAS_LOOKUP, HAS_TRUTH, BLOCK, BLOCK,
        )  # fmt: skip
        # 8 bytes an entry; the largest value is the current step's lowest reader row.
        # Relaxed: only the kernel boundary orders these against stamp's loads.
        tl.atomic_max(
            read_marks_ptr + slot, tl.zeros_like(slot) + read_base + (READER_LIMIT - 1 - r), mask=live, sem="relaxed"
        )
        n_hit = tl.sum((reasons != 0).to(tl.int32))
        if n_hit > 0:  # clean items leave their count at 0
            tl.atomic_xchg(counts_ptr + item, n_hit)
            bits += reason_counts(reasons)
            found += n_hit
    mark_writes(
        pid, n_programs, n_witems, b, loc_ptr, lookup_ptr, woff_ptr, witems_ptr, write_marks_ptr, n_tokens, n_lookup,
        num_slots, mark, positions_ptr, old_pos_ptr, window, res0, res1, res2, res3, res4, res5, res6, res7,
        w_row_ends, rb, wfirst_v, tbegin_v, write_end, HAS_LOOKUP, STAMP_BLOCK, BLOCK_B, FUSED,
    )  # fmt: skip
    if found > 0:
        tl.atomic_add(sync_ptr + PENDING, found)
    if found + plan_found > 0:
        add_counters(counters_ptr, bits)

    ticket = finish(sync_ptr, counters_ptr, pid, VERIFIED, n_verify, SKIPPED, planned - n_verify, CALLS, n_calls, False)
    if ticket == n_programs - 1:
        if HAS_PHASE_MARK:  # the step's before-forward phase mark, counted by the launch's last program
            tl.store(phase_mark_ptr, tl.load(phase_mark_ptr) + 1)
        if FUSED:
            total, plan_total = close_fused_call(sync_ptr)
            tl.store(epoch_ptr, step_epoch)
        else:
            total = close_call(sync_ptr)
            plan_total = tl.zeros((), tl.int64)
        if total + plan_total > 0:
            base = tl.atomic_add(counters_ptr + VIOLATIONS, total + plan_total)
            if FUSED:  # noqa: SIM102  (a static test: Triton does not mix it with a runtime one in `and`)
                if plan_total > 0:
                    log_plan_rows(
                        first_ptr, last_ptr, log_k, base, base + plan_total, group_id, rows_ptr, pre_ptr, ext_ptr,
                        table_ptr, lookup_ptr, links_ptr, 0, b, tl.zeros((), tl.int64), n_rows, n_cols, width,
                        n_lookup, num_slots, n_tokens, window, has_pad, pad_row, page, res0, res1, res2, res3, res4,
                        res5, res6, res7, PAGED, HAS_LOOKUP, BLOCK_B,
                    )  # fmt: skip
            base += plan_total
            prefix = tl.zeros((), tl.int64)
            for c0 in range(0, n_items, SCAN):
                idx, excl, want, prefix = select_items(counts_ptr, c0, n_items, prefix, base, total, log_k)
                for _ in range(tl.sum(want.to(tl.int32))):
                    j, rank = next_item(idx, excl, want)
                    r, chunk, e_begin, e_end, trow, start = _verify_row(
                        j, row_ends, rb, first_v, begin_v, verify_end, rows_v, starts_v, rows_ptr, voff_ptr,
                        starts_ptr, vitems_ptr, b, n_verify, BLOCK_B, FUSED,
                    )  # fmt: skip
                    # Re-derive the item in narrow sub-blocks: this rare path must not raise the
                    # kernel's register count.
                    for sub in range(BLOCK // FINAL_LANES):
                        trow, _m, slot, pred, pos, spos, etok, stok, elink, slink, bad, reasons = _verify_item(
                            r, chunk, e_begin, e_end, trow, start, sub, table_ptr, lookup_ptr, truth_ptr,
                            truth_lens_ptr, tokens_ptr, positions_ptr, links_ptr, n_rows, n_cols, n_lookup, t_rows,
                            t_cols, num_slots, page, token_offset, res0, res1, res2, res3, res4, res5, res6, res7,
                            PAGED, HAS_LOOKUP, HAS_TRUTH, BLOCK, FINAL_LANES,
                        )  # fmt: skip
                        hit = reasons != 0
                        hit64 = hit.to(tl.int64)
                        g = base + rank + tl.cumsum(hit64, 0) - hit64
                        store_rows(
                            first_ptr, last_ptr, log_k, g, base + total, hit, reasons, PHASE_VERIFY, group_id, r, trow,
                            slot, pred, pos, spos, etok, stok, elink, slink, bad,
                        )  # fmt: skip
                        rank += tl.sum(hit64)
                    want = want & (idx != j)
