# mypy: disable-error-code="no-untyped-def"
"""A small step's plan, verify and stamp in one launch.

A small step (a few rows, one wave of programs: :func:`~kvcanary.ops.kernel_tuning.fuses_step`) costs a chain
of dependent memory round trips, not bandwidth: two launches paid the launch and the row spans twice.  Here the
programs run the fused plan + verify, meet at a barrier, then stamp.  The barrier is the verify's own ticket:
the program that takes the last one has seen every program's read and write marks and the plan's seeds, and
releases the others (``GO``) before it appends verify's log rows; stamp's log rows still come after them,
because stamp's finalize waits for every program, that one included.  Spinning is safe only because every
program of one wave is resident; under the interpreter, which runs programs one after another, the grid is one
program.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvcanary.ops.kernels.stamp import stamp_phase
from kvcanary.ops.kernels.verify import verify_phase


# Integer arguments are not specialised: one compiled kernel serves every batch shape.
@triton.jit(
    do_not_specialize=[
        "b", "n_rows", "n_cols", "n_lookup", "t_rows", "t_cols", "num_slots", "capacity", "max_items", "log_k",
        "group_id", "page", "token_offset", "res0", "res1", "res2", "res3", "res4", "res5", "res6", "res7",
        "n_tokens", "window", "width", "has_pad", "pad_row", "n_powers", "stamp_items",
    ]
)  # fmt: skip
def step_kernel(
    rows_ptr, table_ptr, lookup_ptr, truth_ptr, truth_lens_ptr, tokens_ptr, positions_ptr, links_ptr,
    voff_ptr, starts_ptr, vitems_ptr, counts_ptr, sync_ptr, first_ptr, last_ptr, counters_ptr,
    loc_ptr, woff_ptr, witems_ptr, epoch_ptr, read_marks_ptr, write_marks_ptr, old_pos_ptr,
    pre_ptr, ext_ptr, seeds_ptr, state_ptr,
    b, n_rows, n_cols, n_lookup, t_rows, t_cols, num_slots, capacity, max_items, log_k, group_id, page, token_offset,
    res0, res1, res2, res3, res4, res5, res6, res7, n_tokens, window, width, has_pad, pad_row,
    ids_ptr, in_positions_ptr, mult_ptr, inv_ptr, stamp_counts_ptr, sums_ptr, flags_ptr, stamp_sync_ptr,
    n_powers, stamp_items,
    PAGED: tl.constexpr, HAS_LOOKUP: tl.constexpr, HAS_TRUTH: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_B: tl.constexpr, STAMP_BLOCK: tl.constexpr, CARRY_BLOCK: tl.constexpr,
    POLLS: tl.constexpr, CHECK_NEW: tl.constexpr,
):  # fmt: skip
    """verify_kernel's arguments (``positions_ptr``: the records'), then stamp's own: the batch's token ids and
    positions, the powers, stamp's scratch and sync words, and its item bound."""
    step_epoch = verify_phase(
        rows_ptr, table_ptr, lookup_ptr, truth_ptr, truth_lens_ptr, tokens_ptr, positions_ptr, links_ptr, voff_ptr,
        starts_ptr, vitems_ptr, counts_ptr, sync_ptr, first_ptr, last_ptr, counters_ptr, loc_ptr, woff_ptr,
        witems_ptr, epoch_ptr, read_marks_ptr, write_marks_ptr, old_pos_ptr, pre_ptr, ext_ptr, seeds_ptr, state_ptr,
        b, n_rows, n_cols, n_lookup, t_rows, t_cols, num_slots, capacity, max_items, log_k, group_id, page,
        token_offset, res0, res1, res2, res3, res4, res5, res6, res7, n_tokens, window, width, has_pad, pad_row,
        PAGED, HAS_LOOKUP, HAS_TRUTH, BLOCK, BLOCK_B, STAMP_BLOCK, True, True,
    )  # fmt: skip
    stamp_phase(
        rows_ptr, pre_ptr, ids_ptr, in_positions_ptr, loc_ptr, lookup_ptr, truth_ptr, truth_lens_ptr, woff_ptr,
        seeds_ptr, witems_ptr, mult_ptr, inv_ptr, tokens_ptr, positions_ptr, links_ptr, stamp_counts_ptr, sums_ptr,
        flags_ptr, stamp_sync_ptr, first_ptr, last_ptr, counters_ptr, table_ptr, step_epoch, read_marks_ptr,
        write_marks_ptr, old_pos_ptr, b, n_tokens, n_powers, n_lookup, t_rows, t_cols, num_slots, stamp_items, log_k,
        group_id, token_offset, res0, res1, res2, res3, res4, res5, res6, res7, n_rows, n_cols, page, window,
        ext_ptr, width, has_pad, pad_row, HAS_LOOKUP, HAS_TRUTH, STAMP_BLOCK, BLOCK_B, CARRY_BLOCK, POLLS, PAGED,
        CHECK_NEW, True,
    )  # fmt: skip
