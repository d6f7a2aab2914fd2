# mypy: disable-error-code="no-untyped-def"
"""The transformers adapter's per-group translation in one launch (its launcher and its PyTorch spec live
in ``kvcanary.adapters.transformers_cb.translate_kernel`` and ``.translate``).

Three independent ranges over one grid, each element written by one program:

* ``out[i]``, i < n_tok: the canary slot of write index i (the write trash by design and tokens past the
  translated writes are ``NOT_STORED``);
* ``cells[cell[e]]``, e < n_entries: the canary slot of the read index entry ``cu_k[row] + offset`` when
  the row's read segment has the length the scheduler expects, else the invalid slot;
* ``cells[edge[j]]``: the read-trash slot (the cell just before a sliding window).

A physical index maps to a slot as ``GroupGeometry.to_slots`` does: block * page + offset inside the pool
and the page, the sentinel index to the sentinel slot, anything else to the invalid slot.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvcanary.ops.kernels.const import const
from kvcanary.schema import NOT_STORED

NOT_STORED_SLOT = const(NOT_STORED)
REJECTED_SEGMENT = const(-(1 << 30))


@triton.jit
def _to_slots(idx, stride, page, pool_end, sentinel_index, sentinel_slot, invalid_slot):
    in_pool = (idx >= 0) & (idx < pool_end)
    safe = tl.where(in_pool, idx, 0)
    block = safe // stride
    offset = safe - block * stride
    valid = in_pool & (offset < page)
    slot = tl.where(valid, block * page + offset, invalid_slot)
    return tl.where(idx == sentinel_index, sentinel_slot, slot)


# Sizes change every step: not specialised, so one compiled kernel per group geometry serves every step.
@triton.jit(do_not_specialize=["n_tok", "n_write", "n_entries", "n_read", "n_edges"])
def translate_kernel(
    write_ptr, trash_ptr, out_ptr,
    read_ptr, cu_ptr, expected_ptr, row_ptr, offset_ptr, cell_ptr, edge_ptr, cells_ptr,
    n_tok, n_write, n_entries, n_read, n_edges,
    stride, page, pool_end, sentinel_index, sentinel_slot, invalid_slot, read_trash_slot, write_trash_index,
    HAS_TRASH: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    zero = tl.zeros_like(offs).to(tl.int64)  # scalars widened before comparisons (the interpreter's typing)

    # writes -> out_cache_loc
    m_out = offs < n_tok + zero
    m_w = offs < n_write + zero
    w = tl.load(write_ptr + offs, mask=m_w, other=0).to(tl.int64)
    s = _to_slots(w, stride + zero, page + zero, pool_end + zero, sentinel_index + zero, sentinel_slot + zero,
                  invalid_slot + zero)  # fmt: skip
    if HAS_TRASH:
        by_design = (tl.load(trash_ptr + offs, mask=m_w, other=0) != 0) & (w == write_trash_index + zero)
        s = tl.where(by_design, NOT_STORED_SLOT + zero, s)
    s = tl.where(m_w, s, NOT_STORED_SLOT + zero)
    tl.store(out_ptr + offs, s, mask=m_out)

    # verified entries -> table cells
    m_e = offs < n_entries + zero
    r = tl.load(row_ptr + offs, mask=m_e, other=0).to(tl.int64)
    c0 = tl.load(cu_ptr + r, mask=m_e, other=0).to(tl.int64)
    c1 = tl.load(cu_ptr + r + 1, mask=m_e, other=0).to(tl.int64)
    seg_ok = (c1 - c0) == tl.load(expected_ptr + r, mask=m_e, other=0).to(tl.int64)
    src = tl.where(seg_ok, c0, REJECTED_SEGMENT + zero) + tl.load(offset_ptr + offs, mask=m_e, other=0).to(tl.int64)
    inside = m_e & (src >= 0) & (src < n_read + zero)
    idx = tl.load(read_ptr + src, mask=inside, other=0).to(tl.int64)
    idx = tl.where(inside, idx, -1 + zero)
    slot = _to_slots(idx, stride + zero, page + zero, pool_end + zero, sentinel_index + zero, sentinel_slot + zero,
                     invalid_slot + zero)  # fmt: skip
    cell = tl.load(cell_ptr + offs, mask=m_e, other=0)
    tl.store(cells_ptr + cell, slot.to(tl.int32), mask=m_e)

    # cells just before a sliding window -> the read trash
    m_g = offs < n_edges + zero
    edge = tl.load(edge_ptr + offs, mask=m_g, other=0)
    tl.store(cells_ptr + edge, (read_trash_slot + zero).to(tl.int32), mask=m_g)
