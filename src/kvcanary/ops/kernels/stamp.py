# mypy: disable-error-code="no-untyped-def"
"""Stamp on device: programs walk work items (one block of one row's written tokens).

Links use the reference's closed form of the affine scan, ``link_t = M**(i+1) * seed + M**t * S_t`` with
``S_t`` the sum of ``mix_j * M**-j`` over the row's tokens up to t: a plain wrapping sum, so each item
adds the tokens of the row's earlier blocks (its carry) to a block-local cumsum.  No thread walks a
request serially.  The last program to finish appends the first-K / last-K rows (see :mod:`.log`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvcanary.ops.kernels.codes import (
    LOOKUP_OOR,
    MARK_PERIOD,
    NOT_STORED,
    PHASE_STAMP,
    RESERVED,
    SLOT_OOR,
    WRITE_POSITION_BAD,
    WRITE_TOKEN_BAD,
)
from kvcanary.ops.kernels.const import const
from kvcanary.ops.kernels.hashing import mix
from kvcanary.ops.kernels.indexing import (
    expected_token,
    find_row,
    in_pool,
    is_reserved,
    pick,
    translate,
)
from kvcanary.ops.kernels.log import (
    CALLS,
    COUNTER_LANES,
    EPOCH,
    NO_ITEM,
    PENDING,
    SCAN,
    STAMPED,
    VIOLATIONS,
    add_counters,
    close_call,
    finish,
    next_item,
    reason_counts,
    select_items,
    store_rows,
)
from kvcanary.ops.kernels.marks import same_step_reasons
from kvcanary.ops.kernels.plan import row_spans

FINAL_LANES = const(128)  # tokens per sub-block when the finalize re-derives an item
LOOK = const(64)  # earlier items of the row read per step of the carry look-back


@triton.jit
def _scan_terms(ids_ptr, positions_ptr, inv_ptr, t, mask, n_powers):
    """mix(token_t, position_t) * M**-t (0 where masked), and the token / position as written."""
    tok32 = tl.load(ids_ptr + t, mask=mask, other=0).to(tl.int32)
    pos64 = tl.load(positions_ptr + t, mask=mask, other=0).to(tl.int64)
    pos32 = pos64.to(tl.int32)
    inv = tl.load(inv_ptr + t, mask=mask & (t < n_powers), other=0)
    return tl.where(mask, mix(tok32, pos32) * inv, 0), tok32, pos32, pos64


@triton.jit
def _block_sum(ids_ptr, positions_ptr, inv_ptr, begin, end, n_tokens, n_powers, CARRY_BLOCK: tl.constexpr):
    """Sum of mix * M**-t over tokens [begin, end), CARRY_BLOCK at a time."""
    acc = tl.zeros((CARRY_BLOCK,), tl.int64)
    for k0 in range(begin, end, CARRY_BLOCK):
        tk = k0 + tl.arange(0, CARRY_BLOCK)
        wk, _tok, _pos32, _pos64 = _scan_terms(
            ids_ptr, positions_ptr, inv_ptr, tk, (tk >= 0) & (tk < end) & (tk < n_tokens), n_powers
        )
        acc += wk
    return tl.sum(acc)


@triton.jit
def _carry(
    ids_ptr, positions_ptr, inv_ptr, sums_ptr, flags_ptr, first_item, item, t_begin, epoch, n_tokens, n_powers,
    BLOCK: tl.constexpr, CARRY_BLOCK: tl.constexpr, LOOKBACK: tl.constexpr, POLLS: tl.constexpr,
):  # fmt: skip
    """Sum of mix * M**-t over the row's tokens before ``item``'s block.

    With LOOKBACK, earlier items' sums that this call already published (flag == epoch) are read.
    Their programs started with this one and publish after one round trip, so the flags are polled
    up to POLLS times; the sums still missing then are recomputed here, so no program waits unboundedly.
    """
    carry = tl.zeros((), tl.int64)
    if LOOKBACK:
        for i0 in range(first_item, item, LOOK):
            idx = (i0 + tl.arange(0, LOOK)).to(tl.int64)
            mk = idx < item
            ready = mk & (tl.atomic_add(flags_ptr + idx, 0, mask=mk) == epoch)
            pending = mk & ~ready
            tries = tl.zeros((), tl.int32)
            while (tl.max(pending.to(tl.int32)) > 0) & (tries < POLLS):
                seen = pending & (tl.atomic_add(flags_ptr + idx, 0, mask=pending) == epoch)
                ready = ready | seen
                pending = pending & ~seen
                tries += 1
            carry += tl.sum(tl.where(ready, tl.atomic_add(sums_ptr + idx, 0, mask=ready), 0))
            missing = mk & ~ready
            for _ in range(tl.sum(missing.to(tl.int32))):
                j = tl.min(tl.where(missing, idx, NO_ITEM))
                jb = t_begin + (j - first_item) * BLOCK
                carry += _block_sum(ids_ptr, positions_ptr, inv_ptr, jb, jb + BLOCK, n_tokens, n_powers, BLOCK)
                missing = missing & (idx != j)
    else:
        block_begin = t_begin + (item - first_item) * BLOCK
        carry = _block_sum(ids_ptr, positions_ptr, inv_ptr, t_begin, block_begin, n_tokens, n_powers, CARRY_BLOCK)
    return carry


@triton.jit
def _stamp_row(
    item, row_ends, rb, first_v, end_v, tbegin_v, tend_v, pre_v, rows_v, witems_ptr, woff_ptr, pre_ptr, rows_ptr, b,
    n_tokens, BLOCK_B: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """Stamp item ``item``'s row: (row, first and end item of the row, its tokens [begin, end), prefix length,
    table row).  ROWS: from the launch's row vectors; else from the plan's workspace."""
    if ROWS:
        r = tl.sum((row_ends <= item).to(tl.int64))
        sel = rb == tl.zeros_like(rb) + r  # widened before comparing (interpreter, see indexing.py)
        first_item = pick(sel, first_v)
        last_item = pick(sel, end_v)
        t_begin = pick(sel, tbegin_v)
        t_end = pick(sel, tend_v)
        pre = pick(sel, pre_v)
        trow = pick(sel, rows_v)
    else:
        if b <= BLOCK_B:
            r = tl.sum((row_ends <= item).to(tl.int64))
        else:
            r = find_row(witems_ptr, b, item, BLOCK_B)
        first_item = tl.load(witems_ptr + r)
        last_item = tl.load(witems_ptr + r + 1)
        t_begin = tl.load(woff_ptr + r)
        t_end = tl.load(woff_ptr + r + 1)
        pre = tl.load(pre_ptr + r).to(tl.int64)
        trow = tl.load(rows_ptr + r).to(tl.int64)
    return r, first_item, last_item, t_begin, tl.minimum(t_end, n_tokens), pre, trow


@triton.jit
def _stamp_item(
    item, sub, r, first_item, last_item, t_begin, t_end, pre, trow, rows_ptr, ids_ptr, positions_ptr, loc_ptr,
    lookup_ptr, truth_ptr, truth_lens_ptr,
    woff_ptr, seeds_ptr, witems_ptr, mult_ptr, inv_ptr, sums_ptr, flags_ptr, epoch,
    step_epoch, read_marks_ptr, write_marks_ptr, old_pos_ptr, table_ptr, n_rows, n_cols, page, window,
    b, n_tokens, n_powers, n_lookup, t_rows, t_cols, num_slots, token_offset,
    res0, res1, res2, res3, res4, res5, res6, res7,
    HAS_LOOKUP: tl.constexpr, HAS_TRUTH: tl.constexpr, BLOCK: tl.constexpr, LANES: tl.constexpr,
    BLOCK_B: tl.constexpr, CARRY_BLOCK: tl.constexpr, LOOKBACK: tl.constexpr, POLLS: tl.constexpr,
    PAGED: tl.constexpr, CHECK_NEW: tl.constexpr,
):  # fmt: skip
    """reference.stamp for tokens [sub * LANES, (sub + 1) * LANES) of one item: records and log fields.

    With LOOKBACK (the main pass, LANES == BLOCK) the item publishes its block's sum for the row's
    later items when it has any.
    """
    seed = tl.load(seeds_ptr + r)
    i = (item - first_item) * BLOCK + sub * LANES + tl.arange(0, LANES)
    t = t_begin + i
    m = (t >= 0) & (t < t_end)

    w, tok32, pos32, pos64 = _scan_terms(ids_ptr, positions_ptr, inv_ptr, t, m, n_powers)
    if LOOKBACK:
        if item + 1 < last_item:
            tl.atomic_xchg(sums_ptr + item, tl.sum(w))
            tl.atomic_xchg(flags_ptr + item, epoch)  # after the sum, same thread: readers see both
        carry = _carry(
            ids_ptr, positions_ptr, inv_ptr, sums_ptr, flags_ptr, first_item, item, t_begin, epoch, n_tokens,
            n_powers, BLOCK, CARRY_BLOCK, True, POLLS,
        )  # fmt: skip
    else:
        carry = _block_sum(
            ids_ptr, positions_ptr, inv_ptr, t_begin, t_begin + (item - first_item) * BLOCK + sub * LANES,
            n_tokens, n_powers, CARRY_BLOCK,
        )  # fmt: skip
    seg = carry + tl.cumsum(w, 0)
    mult_next = tl.load(mult_ptr + i + 1, mask=m & (i + 1 < n_powers), other=0)
    mult_t = tl.load(mult_ptr + t, mask=m & (t < n_powers), other=0)
    links = mult_next * seed + mult_t * seg

    full = tl.load(loc_ptr + t, mask=m, other=0).to(tl.int64)
    stored = m & (full != NOT_STORED)  # -1: computed but not kept (no slot check; the chain still advances)
    slot, lookup_bad = translate(lookup_ptr, n_lookup, full, stored, HAS_LOOKUP)
    lookup_bad = lookup_bad & stored
    ok = stored & ~lookup_bad & in_pool(slot, num_slots)
    slot_oor = stored & ~lookup_bad & ~ok
    reserved = ok & is_reserved(slot, res0, res1, res2, res3, res4, res5, res6, res7)
    writable = ok & ~reserved
    exp_pos = pre + i
    exp_tok = expected_token(truth_ptr, truth_lens_ptr, r, trow, exp_pos + token_offset, t_rows, t_cols, m, HAS_TRUTH)
    wpos_bad = m & (pos64 != exp_pos)
    wtok_bad = m & (exp_tok != -1) & (tok32.to(tl.int64) != exp_tok)
    same, same_index, named = same_step_reasons(
        slot, writable, t, exp_pos, pre, trow, r, 1 + step_epoch % MARK_PERIOD, step_epoch, read_marks_ptr,
        write_marks_ptr, old_pos_ptr, table_ptr,
        lookup_ptr,
        n_rows, n_cols, page, window, n_lookup, num_slots, res0, res1, res2, res3, res4, res5, res6, res7,
        PAGED, HAS_LOOKUP, CHECK_NEW,
    )  # fmt: skip
    reasons = (
        tl.where(lookup_bad, LOOKUP_OOR, 0)
        | tl.where(slot_oor, SLOT_OOR, 0)
        | tl.where(reserved, RESERVED, 0)
        | tl.where(wpos_bad, WRITE_POSITION_BAD, 0)
        | tl.where(wtok_bad, WRITE_TOKEN_BAD, 0)
        | same
    ).to(tl.int64)
    bad_index = tl.where(lookup_bad, full, tl.where(slot_oor, slot, same_index))
    named_trow = tl.load(rows_ptr + named, mask=m, other=0).to(tl.int64)
    return named, named_trow, slot, writable, tok32, pos32, pos64, links, exp_pos, exp_tok, bad_index, reasons


# Integer arguments are not specialised: one compiled kernel serves every batch shape.
@triton.jit(
    do_not_specialize=[
        "b", "n_tokens", "n_powers", "n_lookup", "t_rows", "t_cols", "num_slots", "max_items", "log_k", "group_id",
        "token_offset", "res0", "res1", "res2", "res3", "res4", "res5", "res6", "res7",
        "n_rows", "n_cols", "page", "window", "width", "has_pad", "pad_row",
    ]
)  # fmt: skip
def stamp_kernel(
    rows_ptr, pre_ptr, ids_ptr, positions_ptr, loc_ptr, lookup_ptr, truth_ptr, truth_lens_ptr,
    woff_ptr, seeds_ptr, witems_ptr, mult_ptr, inv_ptr,
    tokens_ptr, rec_positions_ptr, links_ptr, counts_ptr, sums_ptr, flags_ptr, sync_ptr,
    first_ptr, last_ptr, counters_ptr, table_ptr, mark_epoch_ptr, read_marks_ptr, write_marks_ptr, old_pos_ptr,
    b, n_tokens, n_powers, n_lookup, t_rows, t_cols, num_slots, max_items, log_k, group_id, token_offset,
    res0, res1, res2, res3, res4, res5, res6, res7, n_rows, n_cols, page, window, ext_ptr, width, has_pad, pad_row,
    HAS_LOOKUP: tl.constexpr, HAS_TRUTH: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_B: tl.constexpr, CARRY_BLOCK: tl.constexpr, POLLS: tl.constexpr,
    PAGED: tl.constexpr, CHECK_NEW: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    rb = tl.arange(0, BLOCK_B)
    if ROWS:  # the batch fits one row block: the plan's row spans again, from one coalesced load
        _rows_r, m_v, rows_v, pre_v, ext_v, ext_sat, active, write_end, _s, _c, _st, _rb, _lb = row_spans(
            rows_ptr, pre_ptr, ext_ptr, 0, b, tl.zeros((), tl.int64), n_rows, width, n_tokens, window, has_pad,
            pad_row, BLOCK_B,
        )  # fmt: skip
        witems_v = tl.where(active, (ext_v + BLOCK - 1) // BLOCK, 0)
        end_v = tl.cumsum(witems_v, 0)
        row_ends = tl.where(m_v, end_v, NO_ITEM)
        n_items = tl.minimum(tl.sum(witems_v), max_items)
        first_v = end_v - witems_v
        tbegin_v = write_end - ext_sat
    else:
        row_ends = tl.load(witems_ptr + 1 + rb, mask=rb < b, other=NO_ITEM)
        n_items = tl.minimum(tl.load(witems_ptr + b), max_items)
        # Unused stand-ins for the row vectors.
        first_v = row_ends
        end_v = row_ends
        tbegin_v = row_ends
        write_end = row_ends
        pre_v = row_ends
        rows_v = row_ends
    epoch = tl.load(sync_ptr + EPOCH) + 1  # the last program stores it when the call ends
    step_epoch = tl.load(mark_epoch_ptr)  # the same-step marks' epoch (plan bumped it)

    found = tl.zeros((), tl.int64)
    written = tl.zeros((), tl.int64)
    bits = tl.zeros((COUNTER_LANES,), tl.int64)
    for item in range(pid, n_items, n_programs):
        r, first_item, last_item, t_begin, t_end, pre, trow = _stamp_row(
            item, row_ends, rb, first_v, end_v, tbegin_v, write_end, pre_v, rows_v, witems_ptr, woff_ptr, pre_ptr,
            rows_ptr, b, n_tokens, BLOCK_B, ROWS,
        )  # fmt: skip
        _r, _trow, slot, writable, tok32, pos32, _pos64, links, _epos, _etok, _bad, reasons = _stamp_item(
            item, 0, r, first_item, last_item, t_begin, t_end, pre, trow, rows_ptr, ids_ptr, positions_ptr, loc_ptr,
            lookup_ptr, truth_ptr, truth_lens_ptr, woff_ptr, seeds_ptr, witems_ptr, mult_ptr, inv_ptr, sums_ptr,
            flags_ptr, epoch,
            step_epoch, read_marks_ptr, write_marks_ptr, old_pos_ptr, table_ptr, n_rows, n_cols, page, window,
            b, n_tokens, n_powers, n_lookup, t_rows, t_cols, num_slots, token_offset,
            res0, res1, res2, res3, res4, res5, res6, res7,
            HAS_LOOKUP, HAS_TRUTH, BLOCK, BLOCK, BLOCK_B, CARRY_BLOCK, True, POLLS, PAGED, CHECK_NEW,
        )  # fmt: skip
        tl.store(tokens_ptr + slot, tok32, mask=writable)
        tl.store(rec_positions_ptr + slot, pos32, mask=writable)
        tl.store(links_ptr + slot, links, mask=writable)
        written += tl.sum(writable.to(tl.int64))
        n_hit = tl.sum((reasons != 0).to(tl.int32))
        if n_hit > 0:  # clean items leave their count at 0
            tl.atomic_xchg(counts_ptr + item, n_hit)
            bits += reason_counts(reasons)
            found += n_hit
    if found > 0:
        tl.atomic_add(sync_ptr + PENDING, found)
        add_counters(counters_ptr, bits)

    ticket = finish(sync_ptr, counters_ptr, pid, CALLS, 1, CALLS, 0, STAMPED, written, True)
    if ticket == n_programs - 1:
        total = close_call(sync_ptr)
        tl.store(sync_ptr + EPOCH, epoch)
        if total > 0:
            base = tl.atomic_add(counters_ptr + VIOLATIONS, total)
            prefix = tl.zeros((), tl.int64)
            for c0 in range(0, n_items, SCAN):
                idx, excl, want, prefix = select_items(counts_ptr, c0, n_items, prefix, base, total, log_k)
                for _ in range(tl.sum(want.to(tl.int32))):
                    j, rank = next_item(idx, excl, want)
                    jr, first_item, last_item, t_begin, t_end, pre, jtrow = _stamp_row(
                        j, row_ends, rb, first_v, end_v, tbegin_v, write_end, pre_v, rows_v, witems_ptr, woff_ptr,
                        pre_ptr, rows_ptr, b, n_tokens, BLOCK_B, ROWS,
                    )  # fmt: skip
                    for sub in range(BLOCK // FINAL_LANES):  # narrow sub-blocks: see verify.py
                        r, trow, slot, _w, tok32, _p32, pos64, links, exp_pos, exp_tok, bad, reasons = _stamp_item(
                            j, sub, jr, first_item, last_item, t_begin, t_end, pre, jtrow, rows_ptr, ids_ptr,
                            positions_ptr, loc_ptr, lookup_ptr, truth_ptr, truth_lens_ptr, woff_ptr, seeds_ptr,
                            witems_ptr, mult_ptr, inv_ptr, sums_ptr,
                            flags_ptr, epoch, step_epoch, read_marks_ptr, write_marks_ptr, old_pos_ptr, table_ptr,
                            n_rows, n_cols, page, window, b, n_tokens, n_powers, n_lookup, t_rows, t_cols, num_slots,
                            token_offset,
                            res0, res1, res2, res3, res4, res5, res6, res7,
                            HAS_LOOKUP, HAS_TRUTH, BLOCK, FINAL_LANES, BLOCK_B, CARRY_BLOCK, False, POLLS, PAGED,
                            CHECK_NEW,
                        )  # fmt: skip
                        hit = reasons != 0
                        hit64 = hit.to(tl.int64)
                        g = base + rank + tl.cumsum(hit64, 0) - hit64
                        store_rows(
                            first_ptr, last_ptr, log_k, g, base + total, hit, reasons, PHASE_STAMP, group_id, r, trow,
                            slot, -1, exp_pos, pos64, exp_tok, tok32.to(tl.int64), 0, links, bad,
                        )  # fmt: skip
                        rank += tl.sum(hit64)
                    want = want & (idx != j)
