# mypy: disable-error-code="no-untyped-def"
"""Plan on device: one program walks the batch rows in blocks, carrying the row sums between blocks."""

from __future__ import annotations

import triton
import triton.language as tl

from kvcanary.ops.kernels.codes import ACTIVE, BAD, LENGTH_OOR, LOOKUP_OOR, PADDING, PHASE_PLAN, ROW_OOR, SEED_OOR
from kvcanary.ops.kernels.const import const
from kvcanary.ops.kernels.hashing import LINK_ANCHOR
from kvcanary.ops.kernels.indexing import in_pool, is_reserved, table_entry, translate
from kvcanary.ops.kernels.log import CALLS, COUNTER_LANES, VIOLATIONS, add_counters, lane, reason_counts, store_rows
from kvcanary.ops.reference import MAX_EXTEND

MAX_EXT = const(MAX_EXTEND)


@triton.jit
def row_spans(
    rows_ptr, pre_ptr, ext_ptr, c0, b, write_carry, n_rows, width, num_tokens, window, has_pad, pad_row,
    BLOCK_B: tl.constexpr,
):  # fmt: skip
    """reference.plan for batch rows [c0, c0 + BLOCK_B) up to the seeds: one coalesced load, no gathers."""
    r = c0 + tl.arange(0, BLOCK_B)
    m = r < b
    rows = tl.load(rows_ptr + r, mask=m, other=0).to(tl.int64)
    pre = tl.load(pre_ptr + r, mask=m, other=0).to(tl.int64)
    ext = tl.load(ext_ptr + r, mask=m, other=0).to(tl.int64)
    pad = m & (rows == pad_row) & (tl.zeros_like(rows) + has_pad != 0)
    live = m & ~pad
    row_bad = live & ((rows < 0) | (rows >= n_rows))
    ext_sat = tl.where(m, tl.minimum(tl.maximum(ext, 0), MAX_EXT), 0)
    write_end = write_carry + tl.cumsum(ext_sat, 0)
    len_bad = live & ~row_bad & ((pre < 0) | (ext < 0) | (pre > width - ext) | (write_end > num_tokens))
    active = live & ~row_bad & ~len_bad
    starts = tl.where(active & (tl.zeros_like(pre) + window > 0), tl.maximum(pre - window, 0), 0)
    counts = tl.where(active, pre - starts, 0)
    state = tl.where(pad, PADDING, tl.where(active, ACTIVE, BAD))
    return r, m, rows, pre, ext, ext_sat, active, write_end, starts, counts, state, row_bad, len_bad


@triton.jit
def row_seeds(
    table_ptr, lookup_ptr, links_ptr, rows, pre, ext, active, row_bad, len_bad, n_rows, n_cols, n_lookup, num_slots,
    page, res0, res1, res2, res3, res4, res5, res6, res7, PAGED: tl.constexpr, HAS_LOOKUP: tl.constexpr,
):  # fmt: skip
    """The rows' chain seeds and the plan's reasons: the stored link at prefix_len - 1, the anchor when
    there is none to trust."""
    need_seed = active & (ext > 0) & (pre > 0)
    sfull = table_entry(table_ptr, rows, pre - 1, n_rows, n_cols, page, need_seed, PAGED)
    sslot, slookup_bad = translate(lookup_ptr, n_lookup, sfull, need_seed, HAS_LOOKUP)
    slookup_bad = slookup_bad & need_seed
    seed_oor = need_seed & ~slookup_bad & ~in_pool(sslot, num_slots)
    sok = need_seed & ~slookup_bad & ~seed_oor
    slink = tl.load(links_ptr + sslot, mask=sok, other=0)
    trusted = sok & ~is_reserved(sslot, res0, res1, res2, res3, res4, res5, res6, res7) & (slink != 0)
    seeds = tl.where(trusted, slink, LINK_ANCHOR)

    reasons = (
        tl.where(row_bad, ROW_OOR, 0)
        | tl.where(len_bad, LENGTH_OOR, 0)
        | tl.where(slookup_bad, LOOKUP_OOR, 0)
        | tl.where(seed_oor, SEED_OOR, 0)
    ).to(tl.int64)
    bad_index = tl.where(row_bad, rows, tl.where(slookup_bad, sfull, tl.where(seed_oor, sslot, -1)))
    return seeds, reasons, bad_index


@triton.jit
def _plan_rows(
    rows_ptr, pre_ptr, ext_ptr, table_ptr, lookup_ptr, links_ptr,
    c0, b, write_carry, n_rows, n_cols, width, n_lookup, num_slots, num_tokens, window, has_pad, pad_row, page,
    res0, res1, res2, res3, res4, res5, res6, res7,
    PAGED: tl.constexpr, HAS_LOOKUP: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    """Everything reference.plan derives for batch rows [c0, c0 + BLOCK_B)."""
    r, m, rows, pre, ext, ext_sat, active, write_end, starts, counts, state, row_bad, len_bad = row_spans(
        rows_ptr, pre_ptr, ext_ptr, c0, b, write_carry, n_rows, width, num_tokens, window, has_pad, pad_row, BLOCK_B
    )  # fmt: skip
    seeds, reasons, bad_index = row_seeds(
        table_ptr, lookup_ptr, links_ptr, rows, pre, ext, active, row_bad, len_bad, n_rows, n_cols, n_lookup,
        num_slots, page, res0, res1, res2, res3, res4, res5, res6, res7, PAGED, HAS_LOOKUP,
    )  # fmt: skip
    return r, m, rows, pre, ext, active, write_end, tl.sum(ext_sat), starts, counts, seeds, state, reasons, bad_index


@triton.jit
def store_row_state(
    write_off_ptr, verify_off_ptr, verify_items_ptr, write_items_ptr, starts_ptr, seeds_ptr, state_ptr,
    r, m, write_end, verify_end, vitem_end, witem_end, starts, seeds, state,
):  # fmt: skip
    """A row block's workspace rows (masked by ``m``): the four offsets' ends (after their 0 header), the window
    start, the chain seed and the row state, as plan_kernel and the fused plan leave them."""
    tl.store(write_off_ptr + 1 + r, write_end, mask=m)
    tl.store(verify_off_ptr + 1 + r, verify_end, mask=m)
    tl.store(verify_items_ptr + 1 + r, vitem_end, mask=m)
    tl.store(write_items_ptr + 1 + r, witem_end, mask=m)
    tl.store(starts_ptr + r, starts, mask=m)
    tl.store(seeds_ptr + r, seeds, mask=m)
    tl.store(state_ptr + r, state.to(tl.int32), mask=m)


# Integer arguments are not specialised: one compiled kernel serves every batch shape.
@triton.jit(
    do_not_specialize=[
        "b",
        "n_rows",
        "n_cols",
        "width",
        "n_lookup",
        "num_slots",
        "num_tokens",
        "window",
        "has_pad",
        "pad_row",
        "page",
        "log_k",
        "group_id",
        "res0",
        "res1",
        "res2",
        "res3",
        "res4",
        "res5",
        "res6",
        "res7",
    ]
)
def plan_kernel(
    rows_ptr, pre_ptr, ext_ptr, table_ptr, lookup_ptr, links_ptr,
    write_off_ptr, verify_off_ptr, starts_ptr, seeds_ptr, state_ptr, verify_items_ptr, write_items_ptr, epoch_ptr,
    first_ptr, last_ptr, counters_ptr, phase_mark_ptr,
    b, n_rows, n_cols, width, n_lookup, num_slots, num_tokens, window, has_pad, pad_row, page, log_k, group_id,
    res0, res1, res2, res3, res4, res5, res6, res7,
    PAGED: tl.constexpr, HAS_LOOKUP: tl.constexpr, HAS_PHASE_MARK: tl.constexpr,
    VERIFY_BLOCK: tl.constexpr, STAMP_BLOCK: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    """reference.plan with one program: workspace rows, then the log rows in batch-row order.
    HAS_PHASE_MARK: also count the step's before-forward phase mark (one launch fewer in the step)."""
    if HAS_PHASE_MARK:
        tl.store(phase_mark_ptr, tl.load(phase_mark_ptr) + 1)
    tl.store(epoch_ptr, tl.load(epoch_ptr) + 1)  # a new step: earlier same-step marks go stale
    tl.store(write_off_ptr, 0)
    tl.store(verify_off_ptr, 0)
    tl.store(verify_items_ptr, 0)
    tl.store(write_items_ptr, 0)
    write_carry = tl.zeros((), tl.int64)
    verify_carry = tl.zeros((), tl.int64)
    vitem_carry = tl.zeros((), tl.int64)
    witem_carry = tl.zeros((), tl.int64)
    found = tl.zeros((), tl.int64)
    bits = tl.zeros((COUNTER_LANES,), tl.int64)
    for c0 in range(0, b, BLOCK_B):
        r, m, _rows, _pre, ext, active, write_end, ext_sum, starts, counts, seeds, state, reasons, _bad = _plan_rows(
            rows_ptr, pre_ptr, ext_ptr, table_ptr, lookup_ptr, links_ptr,
            c0, b, write_carry, n_rows, n_cols, width, n_lookup, num_slots, num_tokens, window, has_pad, pad_row,
            page, res0, res1, res2, res3, res4, res5, res6, res7, PAGED, HAS_LOOKUP, BLOCK_B,
        )  # fmt: skip
        verify_end = verify_carry + tl.cumsum(counts, 0)
        vitems = (counts + VERIFY_BLOCK - 1) // VERIFY_BLOCK
        witems = tl.where(active, (ext + STAMP_BLOCK - 1) // STAMP_BLOCK, 0)
        vitem_end = vitem_carry + tl.cumsum(vitems, 0)
        witem_end = witem_carry + tl.cumsum(witems, 0)
        store_row_state(
            write_off_ptr, verify_off_ptr, verify_items_ptr, write_items_ptr, starts_ptr, seeds_ptr, state_ptr,
            r, m, write_end, verify_end, vitem_end, witem_end, starts, seeds, state,
        )  # fmt: skip
        hit = reasons != 0
        n_hit = tl.sum(hit.to(tl.int64))
        if n_hit > 0:
            bits += reason_counts(reasons)
        found += n_hit
        write_carry += ext_sum
        verify_carry += tl.sum(counts)
        vitem_carry += tl.sum(vitems)
        witem_carry += tl.sum(witems)

    k = tl.arange(0, COUNTER_LANES)
    bits += tl.where(k == VIOLATIONS, found, 0) + tl.where(k == CALLS, 1, 0)
    base = lane(add_counters(counters_ptr, bits), VIOLATIONS)  # one round trip for every counter
    if found > 0:  # a second pass over the rows writes the found ones, now that their indices are known
        write_carry = tl.zeros((), tl.int64)
        rank = base
        for c0 in range(0, b, BLOCK_B):
            n_logged, ext_sum = log_plan_rows(
                first_ptr, last_ptr, log_k, rank, base + found, group_id, rows_ptr, pre_ptr, ext_ptr, table_ptr,
                lookup_ptr, links_ptr, c0, b, write_carry, n_rows, n_cols, width, n_lookup, num_slots, num_tokens,
                window, has_pad, pad_row, page, res0, res1, res2, res3, res4, res5, res6, res7, PAGED, HAS_LOOKUP,
                BLOCK_B,
            )  # fmt: skip
            rank += n_logged
            write_carry += ext_sum


# --------------------------------------------------------------------------- the plan folded into verify


@triton.jit
def store_plan(
    table_ptr, lookup_ptr, links_ptr,
    write_off_ptr, verify_off_ptr, starts_ptr, seeds_ptr, state_ptr, verify_items_ptr, write_items_ptr,
    r, m, rows, pre, ext, active, row_bad, len_bad, write_end, verify_end, vitem_end, witem_end, starts, state,
    n_rows, n_cols, n_lookup, num_slots, page, res0, res1, res2, res3, res4, res5, res6, res7,
    PAGED: tl.constexpr, HAS_LOOKUP: tl.constexpr,
):  # fmt: skip
    """One program of a fused plan + verify: the workspace rows plan_kernel would leave (stamp and the
    digest read them after the launch), from one row block already derived; returns the rows' reasons."""
    seeds, reasons, _bad = row_seeds(
        table_ptr, lookup_ptr, links_ptr, rows, pre, ext, active, row_bad, len_bad, n_rows, n_cols, n_lookup,
        num_slots, page, res0, res1, res2, res3, res4, res5, res6, res7, PAGED, HAS_LOOKUP,
    )  # fmt: skip
    tl.store(write_off_ptr, 0)
    tl.store(verify_off_ptr, 0)
    tl.store(verify_items_ptr, 0)
    tl.store(write_items_ptr, 0)
    store_row_state(
        write_off_ptr, verify_off_ptr, verify_items_ptr, write_items_ptr, starts_ptr, seeds_ptr, state_ptr,
        r, m, write_end, verify_end, vitem_end, witem_end, starts, seeds, state,
    )  # fmt: skip
    return reasons


@triton.jit
def log_plan_rows(
    first_ptr, last_ptr, log_k, rank, end, group_id,
    rows_ptr, pre_ptr, ext_ptr, table_ptr, lookup_ptr, links_ptr,
    c0, b, write_carry, n_rows, n_cols, width, n_lookup, num_slots, num_tokens, window, has_pad, pad_row, page,
    res0, res1, res2, res3, res4, res5, res6, res7,
    PAGED: tl.constexpr, HAS_LOOKUP: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    """The log rows of the row block from batch row ``c0`` (earlier blocks wrote ``write_carry`` tokens), at
    lifetime indices from ``rank`` (the call's rows end at ``end``); returns the rows found and the block's writes."""
    r, _m, rows, pre, ext, _active, _we, ext_sum, _st, _c, _seeds, _state, reasons, bad_index = _plan_rows(
        rows_ptr, pre_ptr, ext_ptr, table_ptr, lookup_ptr, links_ptr,
        c0, b, write_carry, n_rows, n_cols, width, n_lookup, num_slots, num_tokens, window, has_pad, pad_row, page,
        res0, res1, res2, res3, res4, res5, res6, res7, PAGED, HAS_LOOKUP, BLOCK_B,
    )  # fmt: skip
    hit = reasons != 0
    hit64 = hit.to(tl.int64)
    g = rank + tl.cumsum(hit64, 0) - hit64
    store_rows(
        first_ptr, last_ptr, log_k, g, end, hit, reasons, PHASE_PLAN, group_id, r.to(tl.int64), rows,
        -1, -1, pre, pre + ext, -1, 0, 0, 0, bad_index,
    )  # fmt: skip
    return tl.sum(hit64), ext_sum
