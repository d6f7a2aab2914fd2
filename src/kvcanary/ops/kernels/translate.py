# mypy: disable-error-code="no-untyped-def"
"""The transformers adapter's per-group translation in one launch (its launcher and its PyTorch spec live
in ``kvcanary.adapters.transformers_cb.translate_kernel`` and ``.translate``).

The grid's first ``cdiv(n_tok, BLOCK)`` programs map the writes, the rest expand the rows, ``CHUNKS``
programs a row, each element written by one program:

* ``out[i]``, i < n_tok: the canary slot of write index i (the write trash by design and tokens past the
  translated writes are ``NOT_STORED``);
* row r's table cells ``(r + 1) * width + position`` over its verified span (a full group: positions
  ``0 .. past + query - 1``; a sliding one: the last ``window`` past positions, then the query's): the
  canary slot of the read index entry ``cu_k[r] + offset`` when the row's read segment has the length
  the span has, else the invalid slot.  Rows whose ``rows[r]`` is 0 (left out) have no span;
* the cell just before a sliding window: the read-trash slot;
* with ``COPY_TOKENS`` (one group a step), the forward's first ``sizes[2]`` token ids and positions into the
  translator's own buffers: padding a step's tokens to a shape class then needs no view of the engine's
  tensors (each a few cold torch calls on the host).

Everything that varies from step to step without changing the launch -- the lengths, and how many write
and read indices the engine handed over -- is read from device arrays, so the launch can sit in a CUDA
graph replayed at every step of the same batch shape.

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
@triton.jit(do_not_specialize=["n_tok"])
def translate_kernel(
    write_ptr, trash_ptr, out_ptr, read_ptr, cu_ptr, rows_ptr, past_ptr, query_ptr, sizes_ptr, cells_ptr,
    ids_ptr, pos_ptr, ids_out_ptr, pos_out_ptr,
    n_tok, width, window, stride, page, pool_end, sentinel_index, sentinel_slot, invalid_slot, read_trash_slot,
    write_trash_index,
    SLIDING: tl.constexpr, HAS_TRASH: tl.constexpr, CHUNKS: tl.constexpr, BLOCK: tl.constexpr,
    COPY_TOKENS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    write_programs = tl.cdiv(n_tok, BLOCK)
    lanes = tl.arange(0, BLOCK)
    zero = tl.zeros_like(lanes).to(tl.int64)  # scalars widened before comparisons (the interpreter's typing)
    if pid < write_programs:  # writes -> out_cache_loc
        offs = pid * BLOCK + lanes
        m_w = offs < tl.load(sizes_ptr) + zero
        w = tl.load(write_ptr + offs, mask=m_w, other=0).to(tl.int64)
        s = _to_slots(w, stride + zero, page + zero, pool_end + zero, sentinel_index + zero, sentinel_slot + zero,
                      invalid_slot + zero)  # fmt: skip
        if HAS_TRASH:
            by_design = (tl.load(trash_ptr + offs, mask=m_w, other=0) != 0) & (w == write_trash_index + zero)
            s = tl.where(by_design, NOT_STORED_SLOT + zero, s)
        s = tl.where(m_w, s, NOT_STORED_SLOT + zero)
        tl.store(out_ptr + offs, s, mask=offs < n_tok + zero)
        if COPY_TOKENS:  # the forward's tokens and positions into the translator's own buffers
            m_t = (offs < tl.load(sizes_ptr + 2) + zero) & (offs < n_tok + zero)  # the buffers hold n_tok
            tl.store(ids_out_ptr + offs, tl.load(ids_ptr + offs, mask=m_t, other=0).to(tl.int64), mask=m_t)
            tl.store(pos_out_ptr + offs, tl.load(pos_ptr + offs, mask=m_t, other=0).to(tl.int64), mask=m_t)
    else:  # one chunk of one row's verified span -> table cells
        item = pid - write_programs
        r = (item // CHUNKS).to(tl.int64)
        chunk = item % CHUNKS
        past = tl.load(past_ptr + r).to(tl.int64)
        start = past * 0
        if SLIDING:
            start = tl.maximum(past - window, 0)
        count = tl.where(tl.load(rows_ptr + r) != 0, past - start + tl.load(query_ptr + r).to(tl.int64), 0)
        has = count > 0  # only then may cu_k be read: a batch without entries may hand a short one
        c0 = tl.load(cu_ptr + r, mask=has, other=0).to(tl.int64)
        seg_ok = tl.load(cu_ptr + r + 1, mask=has, other=0).to(tl.int64) - c0 == count
        offs = chunk * BLOCK + lanes
        m_e = offs < count + zero
        src = tl.where(seg_ok, c0, REJECTED_SEGMENT) + offs
        inside = m_e & (src >= 0) & (src < tl.load(sizes_ptr + 1) + zero)
        idx = tl.where(inside, tl.load(read_ptr + src, mask=inside, other=0).to(tl.int64), -1 + zero)
        slot = _to_slots(idx, stride + zero, page + zero, pool_end + zero, sentinel_index + zero, sentinel_slot + zero,
                         invalid_slot + zero)  # fmt: skip
        row_cells = (r + 1) * width + start
        tl.store(cells_ptr + row_cells + offs, slot.to(tl.int32), mask=m_e)
        if SLIDING:  # the cell just before the window -> the read trash
            edge = (offs == 0) & (start + zero > 0) & (count + zero > 0)
            tl.store(cells_ptr + row_cells - 1 + lanes, (read_trash_slot + zero).to(tl.int32), mask=edge)
