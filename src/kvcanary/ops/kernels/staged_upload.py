# mypy: disable-error-code="no-untyped-def"
"""A step's staged bytes brought to the device by the step's own device work (its spec:
:func:`kvcanary.adapters.transformers_cb.staging.upload_reference`).

The translation stages a step's values in pinned host memory and copied them to the device buffer with one
``cudaMemcpyAsync`` a step: a CUDA call, microseconds of host time with the caches cold.  When the canary's manager
publishes its outbox (``runtime/publish.py``), its device counter ``seq`` is the host step's index, so the host writes
step ``k``'s bytes into slot ``k % NUM_SLOTS`` of a pinned block and this kernel, the first launch of the step's
work (inside the canary's step graph), copies slot ``seq % NUM_SLOTS`` into the device buffer: as many int64 words as
the slot's first word says, from its :data:`HEAD_WORDS`-th word on.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["slot_words"])
def staged_upload_kernel(slots_ptr, dev_ptr, seq_ptr, slot_words, HEAD_WORDS: tl.constexpr, NUM_SLOTS: tl.constexpr,
                         BLOCK: tl.constexpr):  # fmt: skip
    slot = tl.load(seq_ptr) % NUM_SLOTS
    base = slots_ptr + slot * slot_words
    n = tl.load(base)
    i = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    m = i < n
    tl.store(dev_ptr + i, tl.load(base + HEAD_WORDS + i, mask=m, other=0), mask=m)
