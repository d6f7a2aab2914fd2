# mypy: disable-error-code="no-untyped-def"
"""Which entries a digest tile covers: G list indices, or G positions of one row's budgeted verify span.

A planned verify selects, per row, the runs of G positions whose run index is ``epoch % period`` modulo
``period`` (``docs/design.md`` §12); :func:`row_spans` counts each row's selected tiles and their prefix, and
:func:`tile_entries` maps a tile to its entries' slots (through the table and lookup), or SKIP / BAD.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvcanary.ops.kernels.const import const
from kvcanary.ops.kernels.indexing import in_pool, is_reserved, table_entry, translate
from kvcanary.ops.kernels.log import lane

SKIP = const(-1)  # entry_slot: nothing to digest
BAD = const(-2)  # entry_slot: an index out of range, reported
POS_BITS = const(32)  # entry_info of a planned entry: row << POS_BITS | position
POS_MASK = const((1 << 32) - 1)


@triton.jit
def row_spans(
    starts_ptr, voff_ptr, state_ptr, rows_ptr, b, epoch, period, BLOCK_B: tl.constexpr, G: tl.constexpr
):  # fmt: skip
    """Per row (BLOCK_B lanes): first selected group, selected tiles, the tiles' exclusive prefix, the span,
    and the table row (loaded with the rest: one round trip fewer before a tile's table reads)."""
    rb = tl.arange(0, BLOCK_B)
    rm = rb < b
    trows = tl.load(rows_ptr + rb, mask=rm, other=0).to(tl.int64)
    active = tl.load(state_ptr + rb, mask=rm, other=1) == 0
    start = tl.load(starts_ptr + rb, mask=rm, other=0)
    count = tl.load(voff_ptr + rb + 1, mask=rm, other=0) - tl.load(voff_ptr + rb, mask=rm, other=0)
    end = tl.where(active & rm, start + count, start)
    lo = start // G
    hi = tl.where(end > start, (end + G - 1) // G, lo)
    ph = epoch % period
    tiles = tl.maximum((hi - ph + period - 1) // period, 0) - tl.maximum((lo - ph + period - 1) // period, 0)
    first = lo + ((ph - lo) % period + period) % period
    incl = tl.cumsum(tiles, 0)
    return first, tiles, incl - tiles, start, end, trows


@triton.jit
def tile_entries(
    tile, locs_ptr, lookup_ptr, trows, table_ptr, n_list, n_lookup, n_rows, n_cols, page, num_slots,
    first, tiles_excl, tiles_incl, starts, ends, period, wmarks_ptr, mark,
    res0, res1, res2, res3, res4, res5, res6, res7,
    FROM_PLAN: tl.constexpr, HAS_LOOKUP: tl.constexpr, PAGED: tl.constexpr, REPORT_RANGE: tl.constexpr,
    G: tl.constexpr,
):  # fmt: skip
    """One tile's entries: (entry index, slot marker, info, read slot, readable) with marker = slot, SKIP
    or BAD.

    ``readable``: the slot is in the pool and not reserved; the read slot is it, else 0 (in bounds).  A
    planned entry whose slot this step also writes is SKIP but still readable, so its bytes can be loaded
    while its write mark is (the caller adds only the sums of entries whose marker is a slot)."""
    lanes = tl.arange(0, G)
    e = tile * G + lanes
    if FROM_PLAN:
        r = tl.sum((tiles_incl <= tile).to(tl.int64))  # rows whose tiles all come before this one
        grp = lane(first, r) + (tile - lane(tiles_excl, r)) * period
        pos = grp * G + lanes
        inside = (pos >= lane(starts, r)) & (pos < lane(ends, r))
        trow = lane(trows, r)
        full = table_entry(table_ptr, trow, pos, n_rows, n_cols, page, inside, PAGED)
        info = (tl.zeros_like(pos) + r) << POS_BITS | pos
        stored = inside
    else:
        m = e < n_list
        full = tl.load(locs_ptr + e, mask=m, other=-1).to(tl.int64)
        stored = m & (full != -1)
        info = full
    slot, lookup_bad = translate(lookup_ptr, n_lookup, full, stored, HAS_LOOKUP)
    ok = stored & ~lookup_bad & in_pool(slot, num_slots)
    usable = ok & ~is_reserved(slot, res0, res1, res2, res3, res4, res5, res6, res7)
    readable = usable
    if FROM_PLAN:  # slots this step also writes are left to the stamp (digest_reference.written_this_step)
        written = tl.load(wmarks_ptr + slot, mask=usable, other=0)
        usable = usable & ((written >> 1) != mark)
    marker = tl.where(usable, slot, SKIP)
    if REPORT_RANGE:
        marker = tl.where(stored & ~ok, BAD, marker)
    return e, marker, info, tl.where(readable, slot, 0), readable
