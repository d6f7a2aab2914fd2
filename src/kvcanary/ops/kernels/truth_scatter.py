# mypy: disable-error-code="no-untyped-def"
"""The transformers adapter's truth write as a kernel that can sit in a CUDA graph (its launcher:
``kvcanary.adapters.transformers_cb.truth_store.TruthScatter``; its spec: ``TruthStore.write``).

A step's new truth tokens vary in number, so a launch sized by them would change every step.  Here the grid
covers what the staging buffer could hold, and how many entries there are and where they sit in that buffer
are read from the device (``meta``: count, the cells' int64 offset, the tokens' int32 offset): one launch
serves every step until the staging buffer grows.  Entry i writes token i into cell i of the store; cells
outside the store and entries outside the buffer are masked off.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def truth_scatter_kernel(table_ptr, words_ptr, halves_ptr, meta_ptr, table_size, n_words, n_halves,
                         BLOCK: tl.constexpr):  # fmt: skip
    offs = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    zero = tl.zeros_like(offs)  # scalars widened before comparisons (the interpreter's typing)
    count = tl.load(meta_ptr) + zero
    at_cell = tl.load(meta_ptr + 1) + offs
    at_token = tl.load(meta_ptr + 2) + offs
    m = (offs < count) & (at_cell >= 0) & (at_cell < n_words + zero) & (at_token >= 0) & (at_token < n_halves + zero)
    cell = tl.load(words_ptr + at_cell, mask=m, other=-1)
    token = tl.load(halves_ptr + at_token, mask=m, other=0)
    tl.store(table_ptr + cell, token, mask=m & (cell >= 0) & (cell < table_size + zero))
