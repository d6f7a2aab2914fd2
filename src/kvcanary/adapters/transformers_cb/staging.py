"""One host-to-device copy per step for everything the host already knows about the step.

The translator computes on the host (numpy) whatever follows from the scheduler's lengths: the batch's
row and length tensors, the table cell of every verified entry, the ground-truth tokens.  Those arrays
are packed into one host buffer and sent with a single copy on the current stream; the device tensors
are views of a persistent device buffer.  A small synchronous copy from ordinary host memory would
wait for the stream -- the model's forward -- to drain, so on CUDA the host buffer is pinned and the
copy asynchronous: nothing waits.

Reuse: each step takes a fresh pinned buffer from PyTorch's caching host allocator, which keeps a
buffer out of circulation until the copies issued from it have run, so the host never overwrites
bytes still in flight.  The device buffer is rewritten by the next step's copy, ordered on the stream
after this step's kernels, so a step's views are valid until the next :meth:`Staging.send`.  On CPU the
views are the host buffer itself, with the same lifetime.  A view is kept and handed out again when an
array recurs with the same dtype, offset and shape (the per-row arrays, every step): slicing a tensor
costs microseconds of host time too.

Views start at :data:`ALIGN`-byte boundaries: the Triton kernels specialise pointer arguments on
16-byte alignment, and a misaligned view would compile another variant of a kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvcanary.adapters.transformers_cb.batch_shapes import RecurringViews

ALIGN = 64
_INITIAL_BYTES = 1 << 16

_TORCH_DTYPES: dict[np.dtype[Any], torch.dtype] = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.bool_): torch.bool,
}


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Staging:
    """The packing buffer of one translator (one device, one stream at a time)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._on_host = device.type == "cpu"
        self._pinned = device.type == "cuda"
        self._capacity = 0
        self._device_buf = torch.empty(0, dtype=torch.uint8, device=device)
        self._typed: dict[np.dtype[Any], torch.Tensor] = {}  # the device buffer as each dtype
        self._views = RecurringViews()  # by (dtype, offset, shape): most recur every step
        self._grow(_INITIAL_BYTES)

    @property
    def capacity(self) -> int:
        return self._capacity

    def _grow(self, need: int) -> None:
        cap = max(_INITIAL_BYTES, 1 << (need - 1).bit_length())
        self._capacity = cap
        self._device_buf = torch.empty(cap, dtype=torch.uint8, device=self.device)
        self._typed = {np_type: self._device_buf.view(t) for np_type, t in _TORCH_DTYPES.items()}
        self._views.clear()

    def send(self, arrays: Sequence[npt.NDArray[np.generic]]) -> list[torch.Tensor]:
        """Copy ``arrays`` (int64, int32 or bool; any shape) to the device; their device views, in order."""
        offsets = []
        end = 0
        for a in arrays:
            if a.dtype not in _TORCH_DTYPES:
                raise TypeError(f"arrays must be int64, int32 or bool, got {a.dtype}")
            offsets.append(end)
            end += _aligned(a.nbytes)
        if end > self._capacity:
            self._grow(end)
        if self._on_host:
            host = self._device_buf
        else:
            host = torch.empty(self._capacity, dtype=torch.uint8, pin_memory=self._pinned)
        flat = host.numpy()
        for a, off in zip(arrays, offsets, strict=True):
            flat[off : off + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        if not self._on_host and end:
            self._device_buf[:end].copy_(host[:end], non_blocking=self._pinned)
        return [self._view(a, off) for a, off in zip(arrays, offsets, strict=True)]

    def _view(self, a: npt.NDArray[np.generic], off: int) -> torch.Tensor:
        """The device view that ``a`` was copied to at byte ``off`` (the same tensor whenever it recurs)."""

        def make() -> torch.Tensor:
            size = a.dtype.itemsize
            view = self._typed[a.dtype][off // size : off // size + a.size]
            return view if a.ndim == 1 else view.view(a.shape)

        return self._views.get((a.dtype, off, a.shape), make)
