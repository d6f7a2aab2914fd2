# mypy: disable-error-code="no-untyped-def"
"""The KV digest on device: :mod:`kvcanary.ops.digest_reference` as one kernel.

Work units are (tile, component): a tile is G entries (G list indices, or G consecutive positions of one
row's budgeted verify span; :mod:`.digest_entries` finds them), a component one strided tensor of the
layout (its address and strides come from a device table, so one launch reads every layer; the word keys
from a key table built with it).  Each unit sums its words' terms per entry and adds them into ``acc``
(wrapping int64 atomics: the sum is order-independent, so the result is exact whatever the schedule).
Components of one element size share a launch; the last launch's last program (a ticket) finalizes every
entry in order: stores digests or compares them, then writes violation rows through :mod:`.log`'s
first-K / last-K placement.  ``AND_STAMP``: a planned verify whose list tiles (the step's writes) follow.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvcanary.ops.kernels.codes import (
    DIGEST_BAD,
    DIGEST_BAD_LANE,
    MARK_PERIOD,
    PHASE_DIGEST_STAMP,
    PHASE_DIGEST_VERIFY,
    SLOT_OOR,
    SLOT_OOR_LANE,
    STAT_CALLS,
    STAT_SKIPPED_TILES,
    STAT_STAMPED,
    STAT_VERIFIED,
)
from kvcanary.ops.kernels.const import const
from kvcanary.ops.kernels.digest_entries import BAD, POS_BITS, POS_MASK, SKIP, row_spans, tile_entries
from kvcanary.ops.kernels.hashing import fmix64
from kvcanary.ops.kernels.log import COUNTER_LANES, TICKET, VIOLATIONS, add_counters, finish, store_rows

# A table row: offset from the table (words; bytes below 8-byte elements), s_block, s_off, s_head, s_dim,
# block_size, heads, dim, words per head, word base.
COMP_WIDTH = const(10)
FIN = const(512)  # entries per step of the finalize


@triton.jit
def _unit_words(
    comp_ptr, keys_ptr, c, blk, off, usable, G: tl.constexpr, HB: tl.constexpr, BJ: tl.constexpr,
    EXACT: tl.constexpr, VEC: tl.constexpr,
):  # fmt: skip
    """Sum of component ``c``'s terms for G slots (uint64 [G]), read as 64-bit words.

    Slot ``s`` is at block ``blk``, offset ``off`` of the component.  One [G, HB, BJ] tile (slots x heads
    x words of a head) a step, all its loads in flight together; keys come from the layout's key table
    (cached, shared by the G slots).  Words are addressed from the table's own pointer (the component's
    word offset from it is in the table), so ``VEC`` (every offset and stride even) lets the compiler
    read two words per load.  ``EXACT``: the tile divides every head row (BJ = words per head, HB divides
    the heads), so nothing is masked: unusable lanes read slot 0 (in bounds) and the caller drops them.
    """
    row = comp_ptr + c * COMP_WIDTH
    word_off = tl.load(row)
    s_block = tl.load(row + 1)
    s_off = tl.load(row + 2)
    s_head = tl.load(row + 3)
    s_dim = tl.load(row + 4)
    heads = tl.load(row + 6).to(tl.int32)
    wph = tl.load(row + 8).to(tl.int32)
    word_base = tl.load(row + 9)
    if VEC:
        word_off = tl.multiple_of(word_off, 2)
        s_block = tl.multiple_of(s_block, 2)
        s_off = tl.multiple_of(s_off, 2)
        s_head = tl.multiple_of(s_head, 2)
        word_base = tl.multiple_of(word_base, 2)
    # Tiles are [heads, slots, words]: the compiler spreads slots over warps, so per-slot values (row
    # offsets, sums) cost few registers, and the head sum stays inside a thread.
    row_off = word_off + blk.to(tl.int64) * s_block + off.to(tl.int64) * s_off
    hh = tl.arange(0, HB)
    jj = tl.arange(0, BJ)
    total = tl.zeros((G,), tl.uint64)
    if EXACT:
        for h0 in range(0, heads, HB):
            h = h0 + hh
            # The key tile is loaded in the word tile's own shape (every slot's lane loads its keys, cached):
            # a [heads, words] load would need a shared-memory exchange and two barriers per step.
            kidx = word_base + (h * BJ)[:, None, None] + (jj[None, None, :] + tl.zeros((1, G, 1), tl.int32))
            key = tl.load(keys_ptr + kidx).to(tl.uint64, bitcast=True)
            woff = h.to(tl.int64)[:, None] * s_head + jj[None, :]
            word = tl.load(comp_ptr + row_off[None, :, None] + woff[:, None, :]).to(tl.uint64, bitcast=True)
            term = fmix64(word ^ key)
            total += tl.sum(tl.sum(term, axis=0), axis=1)
    else:
        for h0 in range(0, heads, HB):
            h = h0 + hh
            for j0 in range(0, wph, BJ):
                j = j0 + jj
                m2 = (h < heads)[:, None] & (j < wph)[None, :]
                key = tl.load(keys_ptr + word_base + (h * wph)[:, None] + j[None, :], mask=m2, other=0)
                woff = h.to(tl.int64)[:, None] * s_head + j.to(tl.int64)[None, :] * s_dim
                valid = m2[:, None, :] & usable[None, :, None]
                word = tl.load(comp_ptr + row_off[None, :, None] + woff[:, None, :], mask=valid, other=0)
                term = fmix64(word.to(tl.uint64, bitcast=True) ^ key.to(tl.uint64, bitcast=True)[:, None, :])
                total += tl.sum(tl.sum(tl.where(valid, term, 0), axis=0), axis=1)
    return total


@triton.jit
def _unit(
    comp_ptr, keys_ptr, c, slot, usable, ESIZE: tl.constexpr, G: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    """Sum of one component's terms for G slots (uint64 [G]), elements assembled into words; unusable
    lanes read nothing and add 0."""
    row = comp_ptr + c * COMP_WIDTH
    addr = tl.load(row) + comp_ptr.to(tl.int64, bitcast=True)  # the table holds byte offsets from itself
    s_block = tl.load(row + 1)
    s_off = tl.load(row + 2)
    s_head = tl.load(row + 3)
    s_dim = tl.load(row + 4)
    bsize = tl.load(row + 5)
    n_words = tl.load(row + 6) * tl.load(row + 8)
    dim = tl.load(row + 7)
    wph = tl.load(row + 8)
    word_base = tl.load(row + 9)
    if ESIZE == 1:
        base = addr.to(tl.pointer_type(tl.uint8))
    elif ESIZE == 2:
        base = addr.to(tl.pointer_type(tl.uint16))
    else:
        base = addr.to(tl.pointer_type(tl.uint32))
    s = tl.where(usable, slot, 0)
    row_off = (s // bsize) * s_block + (s % bsize) * s_off
    total = tl.zeros((G,), tl.uint64)
    for w0 in range(0, n_words, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        wm = w < n_words
        h = w // wph
        j = w % wph
        key = tl.load(keys_ptr + word_base + w, mask=wm, other=0).to(tl.uint64)
        valid = usable[:, None] & wm[None, :]
        EPW: tl.constexpr = 8 // ESIZE
        k = tl.arange(0, EPW)
        d = j[:, None] * EPW + k[None, :]
        off = h[:, None] * s_head + d * s_dim
        m3 = valid[:, :, None] & (d < dim)[None, :, :]
        el = tl.load(base + row_off[:, None, None] + off[None, :, :], mask=m3, other=0).to(tl.uint64)
        word = tl.sum(el << (k * (8 * ESIZE)).to(tl.uint64)[None, None, :], axis=2)
        term = fmix64(word ^ key[None, :])
        total += tl.sum(tl.where(valid, term, 0), axis=1)
    return total


@triton.jit
def _digest_unit(
    comp_ptr, keys_ptr, acc_ptr, eslot_ptr, einfo_ptr, e, marker, info, read_slot, readable, chunk, c_begin, n_cls,
    ESIZE: tl.constexpr, G: tl.constexpr, BLOCK_W: tl.constexpr, HB: tl.constexpr, BJ: tl.constexpr,
    CPU: tl.constexpr, BS_LOG: tl.constexpr, EXACT: tl.constexpr, VEC: tl.constexpr,
):  # fmt: skip
    """One unit: chunk ``chunk``'s components summed for a tile's entries ``e`` and added into ``acc``;
    chunk 0 also records the entries.  Returns the entries it counts (chunk 0's usable ones)."""
    usable = marker >= 0
    n = tl.zeros((), tl.int64)
    if chunk == 0:
        tl.store(eslot_ptr + e, marker)
        tl.store(einfo_ptr + e, info)
        n += tl.sum(usable.to(tl.int64))
    c0 = c_begin + chunk * CPU
    c1 = tl.minimum(c0 + CPU, c_begin + n_cls)
    part = tl.zeros((G,), tl.uint64)
    # Loads by ``readable`` (they need not wait for the write marks), sums added by ``usable``.
    if ESIZE == 8:
        s = read_slot.to(tl.int32)  # slots < 2**31 (DeviceLayout.build)
        if BS_LOG >= 0:  # every component of the launch has block size 2**BS_LOG
            blk = s >> BS_LOG
            off = s & ((1 << BS_LOG) - 1)
            for c in range(c0, c1):
                part += _unit_words(comp_ptr, keys_ptr, c, blk, off, readable, G, HB, BJ, EXACT, VEC)
        else:
            for c in range(c0, c1):
                bsize = tl.load(comp_ptr + c * COMP_WIDTH + 5)
                part += _unit_words(comp_ptr, keys_ptr, c, s // bsize, s % bsize, readable, G, HB, BJ, EXACT, VEC)
    else:
        for c in range(c0, c1):
            part += _unit(comp_ptr, keys_ptr, c, read_slot, readable, ESIZE, G, BLOCK_W)
    tl.atomic_add(acc_ptr + e, part.to(tl.int64, bitcast=True), mask=usable, sem="relaxed")
    return n


@triton.jit
def _finalize(
    digests_ptr, acc_ptr, eslot_ptr, einfo_ptr, rows_ptr, first_ptr, last_ptr, counters_ptr,
    n_entries, n_verified, log_k, group_id, STAMP: tl.constexpr, FROM_PLAN: tl.constexpr, AND_STAMP: tl.constexpr,
):  # fmt: skip
    """Every entry in order: store or compare its digest, count, then write the kept violation rows.
    ``AND_STAMP``: entries from ``n_verified`` on are the stamp's (stored after every compare before them).

    Runs in the program whose ticket came last: that acquire synchronises with every program's release
    of its sums, so the exchanges need no fences of their own (relaxed).  The statistics were added with
    the tickets (:func:`.log.finish`)."""
    n_mismatch = tl.zeros((FIN,), tl.int64)  # per lane, summed once after the loop (no barriers per step)
    n_range = tl.zeros((FIN,), tl.int64)
    for e0 in range(0, n_entries, FIN):
        e = e0 + tl.arange(0, FIN)
        m = e < n_entries
        slot = tl.load(eslot_ptr + e, mask=m, other=SKIP, cache_modifier=".cg")
        usable = m & (slot >= 0)
        d = tl.atomic_xchg(acc_ptr + e, tl.zeros((FIN,), tl.int64), mask=m, sem="relaxed") | 1
        if AND_STAMP:
            st = e >= n_verified
            stored = tl.load(digests_ptr + slot, mask=usable & ~st, other=0)
            mismatch = usable & ~st & (stored != 0) & (stored != d)
            tl.store(acc_ptr + e, d, mask=mismatch)
            tl.store(digests_ptr + slot, d, mask=usable & st)
        elif STAMP:
            tl.store(digests_ptr + slot, d, mask=usable)
            mismatch = usable & (slot < 0)
        else:
            stored = tl.load(digests_ptr + slot, mask=usable, other=0)
            mismatch = usable & (stored != 0) & (stored != d)
            tl.store(acc_ptr + e, d, mask=mismatch)  # kept for the rows' pass: nonzero marks a mismatch
        n_mismatch += mismatch.to(tl.int64)
        n_range += (m & (slot == BAD)).to(tl.int64)
    n_mismatch = tl.sum(n_mismatch)
    n_range = tl.sum(n_range)
    found = n_mismatch + n_range
    if found > 0:
        base = tl.atomic_add(counters_ptr + VIOLATIONS, found)
        lanes = tl.arange(0, COUNTER_LANES)
        counts = tl.where(lanes == DIGEST_BAD_LANE, n_mismatch, tl.where(lanes == SLOT_OOR_LANE, n_range, 0))
        add_counters(counters_ptr, counts)
        rank = tl.zeros((), tl.int64)
        for e0 in range(0, n_entries, FIN):
            e = e0 + tl.arange(0, FIN)
            m = e < n_entries
            slot = tl.load(eslot_ptr + e, mask=m, other=SKIP, cache_modifier=".cg")
            computed = tl.atomic_xchg(acc_ptr + e, tl.zeros((FIN,), tl.int64), mask=m, sem="relaxed")
            mismatch = m & (slot >= 0) & (computed != 0)
            bad = m & (slot == BAD)
            hit = mismatch | bad
            info = tl.load(einfo_ptr + e, mask=hit, other=0, cache_modifier=".cg")
            stored = tl.load(digests_ptr + slot, mask=mismatch, other=0)
            if FROM_PLAN:
                r = info >> POS_BITS
                pos = info & POS_MASK
                trow = tl.load(rows_ptr + r, mask=hit, other=0).to(tl.int64)
                phase = PHASE_DIGEST_VERIFY
            else:
                r = tl.zeros_like(info) - 1
                pos = r
                trow = r
                if STAMP:
                    phase = PHASE_DIGEST_STAMP
                else:
                    phase = PHASE_DIGEST_VERIFY
            hit64 = hit.to(tl.int64)
            g = base + rank + tl.cumsum(hit64, 0) - hit64
            reasons = tl.where(mismatch, DIGEST_BAD, SLOT_OOR).to(tl.int64)
            minus = tl.zeros_like(info) - 1
            store_rows(
                first_ptr, last_ptr, log_k, g, base + found, hit, reasons, phase, group_id, r, trow,
                tl.where(bad, -1, slot), minus, pos, minus, minus, minus, stored, computed,
                tl.where(bad, info, -1),
            )  # fmt: skip
            rank += tl.sum(hit64)


@triton.jit(do_not_specialize=[
    "n_list", "n_lookup", "b", "n_rows", "n_cols", "page", "num_slots", "period", "max_tiles",
    "c_begin", "n_cls", "log_k", "group_id", "res0", "res1", "res2", "res3", "res4", "res5", "res6", "res7",
])  # fmt: skip
def digest_kernel(
    comp_ptr, keys_ptr, locs_ptr, lookup_ptr, rows_ptr, table_ptr, starts_ptr, voff_ptr, state_ptr, pepoch_ptr,
    wmarks_ptr,
    digests_ptr, acc_ptr, eslot_ptr, einfo_ptr, sync_ptr, epoch_ptr, stats_ptr, first_ptr, last_ptr, counters_ptr,
    n_list, n_lookup, b, n_rows, n_cols, page, num_slots, period, max_tiles, c_begin, n_cls, log_k, group_id,
    res0, res1, res2, res3, res4, res5, res6, res7,
    FROM_PLAN: tl.constexpr, STAMP: tl.constexpr, HAS_LOOKUP: tl.constexpr, PAGED: tl.constexpr,
    REPORT_RANGE: tl.constexpr, FINALIZE: tl.constexpr, ESIZE: tl.constexpr, AND_STAMP: tl.constexpr,
    G: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_B: tl.constexpr, HB: tl.constexpr, BJ: tl.constexpr,
    CPU: tl.constexpr, BS_LOG: tl.constexpr, EXACT: tl.constexpr, VEC: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    mark = tl.zeros((), tl.int32)
    if FROM_PLAN:
        mark = (1 + tl.load(pepoch_ptr) % MARK_PERIOD).to(tl.int32)
        epoch = tl.load(epoch_ptr)
        first, tiles, excl, starts, ends, trows = row_spans(
            starts_ptr, voff_ptr, state_ptr, rows_ptr, b, epoch, period, BLOCK_B, G
        )  # fmt: skip
        total_tiles = tl.sum(tiles)
        n_tiles = tl.minimum(total_tiles, max_tiles)
        incl = excl + tiles
    else:
        first = tl.zeros((BLOCK_B,), tl.int64)
        excl = first
        incl = first
        starts = first
        ends = first
        trows = first
        total_tiles = tl.zeros((), tl.int64) + (n_list + G - 1) // G
        n_tiles = total_tiles
    n_chunks = (n_cls + CPU - 1) // CPU  # units: (tile, CPU components), components inner
    done = tl.zeros((), tl.int64)  # entries this program's units digest (counted once, in chunk 0)
    for u in range(pid, n_tiles * n_chunks, n_programs):
        tile = u // n_chunks
        e, marker, info, read_slot, readable = tile_entries(
            tile, locs_ptr, lookup_ptr, trows, table_ptr, n_list, n_lookup, n_rows, n_cols, page, num_slots,
            first, excl, incl, starts, ends, period, wmarks_ptr, mark,
            res0, res1, res2, res3, res4, res5, res6, res7, FROM_PLAN, HAS_LOOKUP, PAGED, REPORT_RANGE, G,
        )  # fmt: skip
        done += _digest_unit(
            comp_ptr, keys_ptr, acc_ptr, eslot_ptr, einfo_ptr, e, marker, info, read_slot, readable, u % n_chunks,
            c_begin, n_cls, ESIZE, G, BLOCK_W, HB, BJ, CPU, BS_LOG, EXACT, VEC,
        )  # fmt: skip
    n_stamp = tl.zeros((), tl.int64)  # AND_STAMP: the list's tiles, entries numbered on from the verify's
    stamped = tl.zeros((), tl.int64)
    if AND_STAMP:  # its units continue the verify's round robin (a loop of its own: no branch per unit)
        n_stamp += (n_list + G - 1) // G
        start = (pid - (n_tiles * n_chunks) % n_programs + n_programs) % n_programs
        for u in range(start, n_stamp * n_chunks, n_programs):
            e, marker, info, read_slot, readable = tile_entries(
                u // n_chunks, locs_ptr, lookup_ptr, trows, table_ptr, n_list, n_lookup, n_rows, n_cols, page,
                num_slots, first, excl, incl, starts, ends, period, wmarks_ptr, mark,
                res0, res1, res2, res3, res4, res5, res6, res7, False, HAS_LOOKUP, PAGED, False, G,
            )  # fmt: skip
            stamped += _digest_unit(
                comp_ptr, keys_ptr, acc_ptr, eslot_ptr, einfo_ptr, e + n_tiles * G, marker, info, read_slot,
                readable, u % n_chunks, c_begin, n_cls, ESIZE, G, BLOCK_W, HB, BJ, CPU, BS_LOG, EXACT, VEC,
            )  # fmt: skip
    if FINALIZE:
        # One vector atomic takes the ticket and adds the statistics (each acq_rel atomic is a round trip
        # on the step's critical path); the ticket's reset and the epoch's advance need no ordering but the
        # kernel boundary's.
        if STAMP:
            done_stat = STAT_STAMPED
        else:
            done_stat = STAT_VERIFIED
        calls = 1
        if AND_STAMP:  # two calls' statistics; the stamp's count goes ahead of the ticket (no round trip)
            calls = 2
            tl.atomic_add(stats_ptr + STAT_STAMPED, stamped, mask=stamped != 0, sem="relaxed")
        ticket = finish(
            sync_ptr, stats_ptr, pid, STAT_CALLS, calls, STAT_SKIPPED_TILES, total_tiles - n_tiles, done_stat, done,
            True,
        )  # fmt: skip
        if ticket == n_programs - 1:
            tl.atomic_xchg(sync_ptr + TICKET, 0, sem="relaxed")
            _finalize(
                digests_ptr, acc_ptr, eslot_ptr, einfo_ptr, rows_ptr, first_ptr, last_ptr, counters_ptr,
                (n_tiles + n_stamp) * G, n_tiles * G, log_k, group_id, STAMP, FROM_PLAN, AND_STAMP,
            )  # fmt: skip
            if FROM_PLAN:
                tl.store(epoch_ptr, epoch + 1)
