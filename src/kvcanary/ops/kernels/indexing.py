# mypy: disable-error-code="no-untyped-def"
"""Index resolution on device, every access masked: the device form of reference.py's helpers."""

from __future__ import annotations

import triton
import triton.language as tl

from kvcanary.ops.kernels.const import const
from kvcanary.schema import UNKNOWN_TOKEN

UNKNOWN = const(UNKNOWN_TOKEN)


@triton.jit
def table_entry(table_ptr, row, pos, n_rows, n_cols, page, mask, PAGED: tl.constexpr):
    """reference.table_slots for (row, pos); loads only inside the table, 0 elsewhere (the value of a lane
    outside the table is unspecified: every caller masks it).

    ``PAGED`` (page > 1) is static so that token tables skip the division.  The division is unsigned 32-bit:
    an int64 one compiles to a call of about 80 instructions a lane for the quotient and another for the
    remainder (sm_90 SASS), most of a small step's instruction path.  Positions inside a row's span,
    ``[0, n_cols * page)``, fit 32 bits (validate_batch refuses wider tables); the others are masked.
    """
    # Scalars are widened before any comparison: the Triton 3.9 interpreter mis-types a broadcast
    # scalar comparison (and the compiled kernels don't care).
    row = row + tl.zeros_like(pos)
    if PAGED:
        page32 = (tl.zeros_like(pos) + page).to(tl.uint32)
        pos32 = pos.to(tl.uint32)
        col32 = pos32 // page32
        col = col32.to(tl.int64)
        inside = (pos >= 0) & (pos < n_cols * page)
    else:
        col = pos
        inside = (pos >= 0) & (col < n_cols)
    ok = mask & (row >= 0) & (row < n_rows) & inside
    value = tl.load(table_ptr + row * n_cols + col, mask=ok, other=0).to(tl.int64)
    if PAGED:
        value = value * page + (pos32 - col32 * page32).to(tl.int64)
    return value


@triton.jit
def translate(lookup_ptr, n_lookup, full, mask, HAS_LOOKUP: tl.constexpr):
    """reference.translate: (slot, lookup_out_of_range); slot is -1 where the lookup index is bad."""
    if HAS_LOOKUP:
        bad = (full < 0) | (full >= n_lookup)
        slot = tl.load(lookup_ptr + full, mask=mask & ~bad, other=0).to(tl.int64)
        slot = tl.where(bad, -1, slot)
    else:
        bad = full != full
        slot = full
    return slot, bad


@triton.jit
def in_pool(slot, num_slots):
    return (slot >= 0) & (slot < num_slots)


@triton.jit
def is_reserved(slot, res0, res1, res2, res3, res4, res5, res6, res7):
    """Unused reserved arguments are -1, which no in-pool slot equals, and come last (launchers._reserved).  Most
    groups reserve one slot: the other seven compares (14 instructions a lane in int64) sit behind one uniform
    branch."""
    hit = slot == res0
    if res1 >= 0:
        hit = hit | (slot == res1) | (slot == res2) | (slot == res3)
        hit = hit | (slot == res4) | (slot == res5) | (slot == res6) | (slot == res7)
    return hit


@triton.jit
def expected_token(truth_ptr, truth_lens_ptr, row, table_row, idx, t_rows, t_cols, mask, HAS_TRUTH: tl.constexpr):
    """reference.expected_tokens: truth[table_row, idx] as int32, -1 where unknown; ``row`` is the batch row."""
    if HAS_TRUTH:
        table_row = table_row + tl.zeros_like(idx)
        valid_len = tl.load(truth_lens_ptr + row).to(tl.int64)
        ok = mask & (idx >= 0) & (idx < valid_len) & (idx < t_cols) & (table_row >= 0) & (table_row < t_rows)
        tok = tl.load(truth_ptr + table_row * t_cols + idx, mask=ok, other=0).to(tl.int32).to(tl.int64)
        out = tl.where(ok, tok, UNKNOWN)
    else:
        out = tl.zeros_like(idx) + UNKNOWN
    return out


@triton.jit
def find_row(offsets_ptr, b, x, BLOCK_B: tl.constexpr):
    """Row r in [0, b) with offsets[r] <= x < offsets[r+1] (for x < offsets[b]); offsets is nondecreasing."""
    row = tl.zeros((), tl.int64)
    for c0 in range(0, b, BLOCK_B):
        r = c0 + tl.arange(0, BLOCK_B)
        ends = tl.load(offsets_ptr + r + 1, mask=r < b, other=0)
        row += tl.sum(((ends <= x) & (r < b)).to(tl.int64))
    return row


@triton.jit
def pick(sel, values):
    """The element of ``values`` where ``sel`` (one lane) holds, as a scalar."""
    return tl.sum(tl.where(sel, values, 0))
