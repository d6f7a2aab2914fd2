"""One host-to-device copy per step for everything the host already knows about the step.

The translator computes on the host (numpy) whatever follows from the scheduler's lengths: the batch's
row and length tensors, the table cell of every verified entry, the ground-truth tokens.  Those arrays
are packed into one host buffer and sent with a single copy on the current stream; the device tensors
are views of a persistent device buffer.  A small synchronous copy from ordinary host memory would
wait for the stream -- the model's forward -- to drain, so on CUDA the host buffer is pinned and the
copy asynchronous: nothing waits.

Reuse: the pinned buffers form a ring of :data:`RING`, each with an event recorded after its copy; a step
takes the next one when its event has completed and otherwise a fresh buffer from PyTorch's caching host
allocator (which keeps the old one out of circulation until its copy has run), so the host never
overwrites bytes still in flight.  Allocating a pinned buffer every step cost more host time than the
event.  The device buffer is rewritten by the next step's copy, ordered on the stream
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

ALIGN = 64
RING = 4  # pinned buffers in rotation: an asynchronous engine keeps a step or two in flight
_INITIAL_BYTES = 1 << 16
_MAX_VIEWS = 1024

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
        self._capacity = 0
        self._device_buf = torch.empty(0, dtype=torch.uint8, device=device)
        self._typed: dict[np.dtype[Any], torch.Tensor] = {}  # the device buffer as each dtype
        self._views: dict[tuple[Any, ...], torch.Tensor] = {}  # by (dtype, offset, shape): most recur every step
        self._ring: list[_Pinned] = []
        self._turn = 0
        self._grow(_INITIAL_BYTES)

    @property
    def capacity(self) -> int:
        return self._capacity

    def _grow(self, need: int) -> None:
        cap = max(_INITIAL_BYTES, 1 << (need - 1).bit_length())
        self._capacity = cap
        self._device_buf = torch.empty(cap, dtype=torch.uint8, device=self.device)
        self._typed = {np_type: self._device_buf.view(t) for np_type, t in _TORCH_DTYPES.items()}
        self._views = {}

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
        pinned = None if self._on_host else self._pinned_buffer()
        host, flat = (self._device_buf, self._device_buf.numpy()) if pinned is None else (pinned.host, pinned.flat)
        for a, off in zip(arrays, offsets, strict=True):
            flat[off : off + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        if pinned is not None and end:
            self._device_buf[:end].copy_(host[:end], non_blocking=True)
            pinned.copied.record()
        return [self._view(a, off) for a, off in zip(arrays, offsets, strict=True)]

    def _pinned_buffer(self) -> _Pinned:
        """The ring's next buffer, or a fresh one in its place when its last copy may still be running."""
        i = self._turn
        self._turn = (i + 1) % RING
        if i < len(self._ring) and self._ring[i].fits(self._capacity):
            return self._ring[i]
        fresh = _Pinned(self._capacity)
        if i < len(self._ring):
            self._ring[i] = fresh
        else:
            self._ring.append(fresh)
        return fresh

    def _view(self, a: npt.NDArray[np.generic], off: int) -> torch.Tensor:
        """The device view that ``a`` was copied to at byte ``off`` (the same tensor whenever it recurs)."""
        key = (a.dtype, off, a.shape)
        view = self._views.get(key)
        if view is None:
            size = a.dtype.itemsize
            view = self._typed[a.dtype][off // size : off // size + a.size]
            view = view if a.ndim == 1 else view.view(a.shape)
            if len(self._views) >= _MAX_VIEWS:
                self._views.clear()
            self._views[key] = view
        return view


class _Pinned:
    """A pinned host buffer, its numpy view and the event recorded after its last copy to the device."""

    __slots__ = ("copied", "flat", "host")

    def __init__(self, nbytes: int) -> None:
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.flat = self.host.numpy()
        self.copied = torch.cuda.Event()  # type: ignore[no-untyped-call]

    def fits(self, nbytes: int) -> bool:
        """Whether it may be refilled for ``nbytes``: the size matches and its last copy has run."""
        return int(self.host.shape[0]) == nbytes and bool(self.copied.query())  # type: ignore[no-untyped-call]
