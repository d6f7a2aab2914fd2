# mypy: disable-error-code="no-untyped-def"
"""The engine's block moves between two steps, applied to the records by the next step's own device work (its spec:
:func:`kvcanary.adapters.transformers_cb.queued_moves.apply_entries`; its launcher: ``QueuedMoves``).

The transformers adapter mirrors each fork copy, offload and restore into the records.  Done at once, each move
cost a dozen torch calls and index builds on the host, tens of microseconds each with the caches cold.  Queued, the
host writes each moved block as one entry into pinned slot ``k % NUM_SLOTS`` for host step ``k`` (the staging's
slotted mode, whose publisher counter ``seq`` is ``k`` while step ``k``'s work runs), and this kernel, one program
inside step ``k``'s graph, applies the slot's entries in the order they were queued, before the step's verify reads
the records.

An entry is three int64 words: the source block (-1: no source, the destination's records are cleared), the
destination block, and flags: bit 0 the source is the host pool's records, bit 1 the destination is, bit ``8 + g``
the move lands in group ``g``.  The records of either side are rows (``RecordRows``): group ``g``'s tokens and
positions are int32 rows ``2g`` and ``2g + 1``, its links int64 row ``g``, each row ``PAGE`` slots a block.  An entry
whose blocks fall outside their side's records is skipped (the host never queues one).  Entries run one after
another, a barrier between: a later entry may read a block an earlier one wrote.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _move_rows(dev, host, dev_row, host_row, row, t, src, dst, m, copy, src_host, dst_host, PAGE: tl.constexpr):
    """Rows ``row`` (masked by ``m``) of block ``src`` into block ``dst``, each block on the side its flag says; zeros
    where there is no source (``copy`` off)."""
    v = tl.load(dev + row * dev_row + src * PAGE + t, mask=m & copy & ~src_host, other=0)
    v += tl.load(host + row * host_row + src * PAGE + t, mask=m & copy & src_host, other=0)
    tl.store(dev + row * dev_row + dst * PAGE + t, v, mask=m & ~dst_host)
    tl.store(host + row * host_row + dst * PAGE + t, v, mask=m & dst_host)


@triton.jit(do_not_specialize=["slot_words", "dev_blocks", "host_blocks"])
def record_moves_kernel(slots_ptr, seq_ptr, slot_words, dev_pairs, dev_links, host_pairs, host_links,
                        dev_pair_row, dev_link_row, host_pair_row, host_link_row, dev_blocks, host_blocks,
                        GROUPS: tl.constexpr, PAGE: tl.constexpr, HEAD_WORDS: tl.constexpr, NUM_SLOTS: tl.constexpr,
                        CAPACITY: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    base = slots_ptr + (tl.load(seq_ptr) % NUM_SLOTS) * slot_words
    n = tl.minimum(tl.maximum(tl.load(base), 0), CAPACITY)
    j = tl.arange(0, BLOCK).to(tl.int64)
    zero = tl.zeros_like(j)  # scalars widened before comparisons (the interpreter's typing)
    t = j % PAGE
    row = j // PAGE  # of the tokens and positions: 2g and 2g + 1 are group g's; of the links: g is
    in_pairs = j < 2 * GROUPS * PAGE
    in_links = j < GROUPS * PAGE
    for i in range(0, n):
        entry = base + HEAD_WORDS + 3 * i
        src = tl.load(entry) + zero
        dst = tl.load(entry + 1) + zero
        flags = tl.load(entry + 2) + zero
        src_host = (flags & 1) != 0
        dst_host = (flags & 2) != 0
        src_limit = tl.where(src_host, host_blocks + zero, dev_blocks + zero)
        dst_limit = tl.where(dst_host, host_blocks + zero, dev_blocks + zero)
        ok = (dst >= 0) & (dst < dst_limit) & (src < src_limit)
        copy = ok & (src >= 0)
        m = ok & in_pairs & (((flags >> (8 + row // 2)) & 1) != 0)  # the groups the move lands in
        _move_rows(dev_pairs, host_pairs, dev_pair_row, host_pair_row, row, t, src, dst, m, copy, src_host, dst_host,
                   PAGE)  # fmt: skip
        ml = ok & in_links & (((flags >> (8 + row)) & 1) != 0)
        _move_rows(dev_links, host_links, dev_link_row, host_link_row, row, t, src, dst, ml, copy, src_host, dst_host,
                   PAGE)  # fmt: skip
        tl.debug_barrier()  # the next entry may read what this one wrote
