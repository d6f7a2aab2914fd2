"""One host-to-device copy per step for everything the host already knows about the step.

The translator computes on the host (numpy) whatever follows from the scheduler's lengths: the batch's
row and length tensors, the table cell of every verified entry, the ground-truth tokens.  Those arrays
are packed into one host buffer and sent with a single copy on the current stream; the device tensors
are views of a persistent device buffer.  A small synchronous copy from ordinary host memory would
wait for the stream -- the model's forward -- to drain, so on CUDA the host buffer is pinned and the
copy asynchronous: nothing waits.

Reuse: the pinned buffers are the staging's own, taken in turn; one whose copy has not run yet is never written:
another buffer joins the ring instead (nothing waits). Whether a copy has run is known from an event recorded behind
it, or, once the staging follows a :class:`~kvcanary.runtime.pump.CopyFence` (the canary manager's, whose pump
copies, or whose step graph publishes, the outbox on the same stream after each step), from the fence: a buffer's
copy was queued before the host step it is tagged with, so it has run once the fence says that step's copy landed.
Then a send is one CUDA call (no event record) and a take asks the device nothing: two calls fewer a step, each tens
of microseconds with the caches cold. The copy and the event go through :mod:`kvcanary.runtime.cuda_calls`, the
calls the host step makes too: in a serving loop the canary's step runs with every cache cold, and each distinct
path it touches (torch's pinned allocator, a tensor copy) costs tens of microseconds there. The device buffer is
rewritten by the next step's copy, ordered on the stream after this step's kernels, so a step's views are valid
until the next :meth:`Staging.send`. On CPU the views are the host buffer itself, with the same lifetime. A view is
kept and handed out again when an array recurs with the same dtype, offset and shape (the per-row arrays, every
step): slicing a tensor costs microseconds of host time too.

Views start at :data:`ALIGN`-byte boundaries: the Triton kernels specialise pointer arguments on
16-byte alignment, and a misaligned view would compile another variant of a kernel.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt
import torch

from kvcanary.adapters.transformers_cb.batch_shapes import RecurringViews
from kvcanary.runtime.cuda_calls import CudaCalls, Transfer, device_index
from kvcanary.runtime.publish import NUM_BUFFERS as PUBLISH_BUFFERS
from kvcanary.runtime.pump import CopyFence

ALIGN = 64
_INITIAL_BYTES = 1 << 16
_RING = 3  # pinned buffers to start with: a step's copy has run long before the buffer comes round again
# Slotted mode (see Staging.follow): host step k's bytes go to slot k % NUM_SLOTS, which step k - 4's upload read last;
# that upload ran before step k - 4's publish, which host step k - 1 took: the publisher's buffers, and as many.
NUM_SLOTS = PUBLISH_BUFFERS
HEAD_WORDS = ALIGN // 8  # a slot's header (its first word: the int64 words to upload), the data aligned after it
UPLOAD_BLOCK = 1024

HostArray: TypeAlias = "npt.NDArray[Any] | array.array[int]"

# (buffer-protocol format, item size) -> torch dtype: numpy's int64 reads as "l" (C long), array's as "q"
_TORCH_DTYPES: dict[tuple[str, int], torch.dtype] = {
    ("q", 8): torch.int64,
    ("l", 8): torch.int64,
    ("i", 4): torch.int32,
    ("?", 1): torch.bool,
}


class _Upload:
    """One pinned host buffer and its transfer into the device buffer (the copy and the event behind it); ``tag``:
    with a fence, the host step its last copy was queued before (-1: none yet)."""

    __slots__ = ("bytes", "tag", "tensor", "transfer")

    def __init__(self, device_buf: torch.Tensor, calls: CudaCalls) -> None:
        self.tensor = torch.empty(device_buf.shape[0], dtype=torch.uint8, pin_memory=True)
        self.bytes = self.tensor.numpy().data
        self.transfer: Transfer = calls.upload(device_buf, self.tensor)
        self.tag = -1


class Staging:
    """The packing buffer of one translator (one device, one stream at a time)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._calls: CudaCalls | None = None
        if device.type == "cuda":
            self._calls = CudaCalls(device_index(device))
        self._capacity = 0
        self._device_buf = torch.empty(0, dtype=torch.uint8, device=device)
        self._typed: dict[torch.dtype, torch.Tensor] = {}  # the device buffer as each dtype
        self._views: RecurringViews[torch.Tensor] = RecurringViews()  # by (dtype, offset, shape): most recur every step
        self._on_host = np.zeros(0, dtype=np.uint8).data  # CPU: the device buffer's bytes
        self._ring: list[_Upload] = []  # CUDA: the pinned buffers, taken in turn
        self._retired: list[_Upload] = []  # outgrown, kept until their copies have run
        self._next = 0
        self.fence: CopyFence | None = None  # see the module docstring: set once, before the first send
        self.generation = -1  # bumped each time the device buffer is replaced (every view of the last one moves)
        self._slots: torch.Tensor | None = None  # slotted mode: [NUM_SLOTS, HEAD_WORDS + capacity / 8] int64, pinned
        self._slot_bytes: list[memoryview] = []  # each slot's data bytes
        self._heads: list[memoryview] = []  # each slot's words (the header first)
        self._upload: UploadLaunch | None = None
        self._retired_slots: list[torch.Tensor] = []  # outgrown: an upload still queued may read one
        self._grow(_INITIAL_BYTES)

    def follow(self, fence: CopyFence | None, slotted: bool = False) -> None:
        """Know from ``fence`` when the copies have run (see the module docstring).  ``slotted``: where the fence has
        a publisher's counter (``fence.seq``), the bytes go to pinned slots and the step's own work uploads them
        (:class:`UploadLaunch`, first in its prelude): no copy call a step."""
        self.fence = fence
        if slotted and fence is not None and fence.seq is not None:
            self._allocate_slots()

    def upload(self) -> UploadLaunch | None:
        """In slotted mode, the launch that brings the last send's bytes to the device buffer (the same object until
        the buffer grows); None otherwise (the send copied them)."""
        return self._upload

    def uploads(self, deferred: bool) -> list[UploadLaunch]:
        """After a send: the upload as the first launch of the step's deferred work, or run now when that work is not
        deferred (it reads the bytes at once); none when the send copied them."""
        if self._upload is None or deferred:
            return [] if self._upload is None else [self._upload]
        self._upload.run()
        return []

    def _allocate_slots(self) -> None:
        assert self.fence is not None and self.fence.seq is not None
        if self._slots is not None:
            self._retired_slots.append(self._slots)
        else:  # slotted from now on: the copy ring is not used again (kept only while a copy of it may be queued)
            self._retired += [u for u in self._ring if not self._landed(u)]
            self._ring = []
        words = HEAD_WORDS + self._capacity // 8
        slots = self._slots = torch.zeros((NUM_SLOTS, words), dtype=torch.int64, pin_memory=self._calls is not None)
        self._heads = [slots[i].numpy().data for i in range(NUM_SLOTS)]
        self._slot_bytes = [h.cast("B")[8 * HEAD_WORDS :] for h in self._heads]
        self._upload = UploadLaunch(slots, self._typed[torch.int64], self.fence.seq)

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def host_buffers(self) -> int:
        """Pinned buffers in the copy ring (CUDA, not slotted; 0 otherwise)."""
        return len(self._ring)

    def _grow(self, need: int) -> None:
        cap = max(_INITIAL_BYTES, 1 << (need - 1).bit_length())
        self._capacity = cap
        self.generation += 1
        self._device_buf = torch.empty(cap, dtype=torch.uint8, device=self.device)
        self._typed = {t: self._device_buf.view(t) for t in set(_TORCH_DTYPES.values())}
        self._views.clear()
        if self._slots is not None:
            self._allocate_slots()
        if self._calls is None:
            self._on_host = self._device_buf.numpy().data
            return
        self._retired = [u for u in self._retired + self._ring if not self._landed(u)]
        # Slotted, the sends write pinned slots and the step's upload copies them: no copy ring.
        self._ring = [] if self._slots is not None else [_Upload(self._device_buf, self._calls) for _ in range(_RING)]
        self._next = 0

    def _landed(self, up: _Upload) -> bool:
        fence = self.fence
        return up.tag <= fence.landed if fence is not None else up.transfer.landed()

    def _take(self) -> _Upload:
        """The next pinned buffer whose last copy has run; a new one joins the ring when it has not.  (The steady
        step's :meth:`send_at` does the same inline.)"""
        up = self._ring[self._next]
        if not self._landed(up):
            up = self._join_ring()
        self._next = (self._next + 1) % len(self._ring)
        return up

    def _copy(self, up: _Upload, nbytes: int) -> None:
        """Queue ``up``'s copy: tagged and without an event when a fence tells when it has run."""
        fence = self.fence
        if fence is None:
            up.transfer.send(nbytes)
        else:
            up.tag = fence.next_step
            up.transfer.copy(nbytes)

    def _join_ring(self) -> _Upload:
        """A new pinned buffer, in the ring at the current place (the one there still has a copy to run)."""
        assert self._calls is not None
        up = _Upload(self._device_buf, self._calls)
        self._ring.insert(self._next, up)
        return up

    def layout(self, arrays: Sequence[HostArray | memoryview]) -> tuple[list[int], int]:
        """Where :meth:`send` puts each of ``arrays`` (byte offsets into the device buffer), and the bytes it sends."""
        pack = Pack(arrays)
        return pack.offsets, pack.end

    def whole(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole device buffer as ``dtype`` (the same tensor until the buffer grows): for device work that
        finds its arrays through offsets staged with them (a launch that stays the same from step to step)."""
        return self._typed[dtype]

    def send(self, arrays: Pack | Sequence[HostArray]) -> list[torch.Tensor]:
        """Copy ``arrays`` (int64, int32 or bool; any shape; or a :class:`Pack` of them) to the device; their device
        views, in order."""
        pack = arrays if isinstance(arrays, Pack) else Pack(arrays)
        end = pack.end
        if end > self._capacity:
            self._grow(end)
        slot = -1 if self._slots is None else self._slot()
        up = None if self._calls is None or slot >= 0 else self._take()
        host = self._slot_bytes[slot] if slot >= 0 else self._on_host if up is None else up.bytes
        views = []
        find = self._views.find
        for m, off in zip(pack.mems, pack.offsets, strict=True):
            host[off : off + m.nbytes] = m.cast("B")
            view = find((m.format, off, m.shape))
            views.append(self._view(m, off) if view is None else view)
        if slot >= 0:
            self._heads[slot][0] = -(-end // 8)
        elif up is not None and end:
            self._copy(up, end)
        return views

    def _slot(self) -> int:
        """Slotted mode: the slot of the host step being translated (the fence's next one)."""
        assert self.fence is not None
        return self.fence.next_step % NUM_SLOTS

    def send_at(self, head: memoryview, tail: Sequence[tuple[int, array.array[int]]], end: int) -> None:
        """Copy ``head`` (bytes, at offset 0) and each ``(offset, array)`` of ``tail`` to the device, as one send of
        ``end`` bytes, laid out by the caller within :attr:`capacity` (views of them: from an earlier :meth:`send`
        of the same layout, while :attr:`generation` has not moved)."""
        if end > self._capacity:
            raise ValueError(f"send_at: {end} bytes do not fit the staging's {self._capacity}")
        fence = self.fence
        if self._slots is not None:  # slotted: the step's upload copies it
            assert fence is not None
            slot = fence.next_step % NUM_SLOTS
            host = self._slot_bytes[slot]
            self._heads[slot][0] = -(-end // 8)
        elif self._calls is None:
            host = self._on_host
        else:  # _take and _copy inline: a steady step runs this every step, cold (each call costs microseconds)
            up = self._ring[self._next]
            if up.tag > fence.landed if fence is not None else up.transfer.sent and not up.transfer.landed():
                up = self._join_ring()
            self._next = (self._next + 1) % len(self._ring)
            host = up.bytes
        host[: len(head)] = head
        for off, a in tail:
            m = memoryview(a).cast("B")
            host[off : off + len(m)] = m
        if self._calls is not None and self._slots is None:
            if fence is None:
                up.transfer.send(end)
            else:
                up.tag = fence.next_step
                up.transfer.copy(end)

    def _view(self, m: memoryview, off: int) -> torch.Tensor:
        """The device view that ``m`` was copied to at byte ``off`` (the same tensor whenever it recurs)."""
        dtype = _TORCH_DTYPES[m.format, m.itemsize]
        shape = m.shape or ()

        def make() -> torch.Tensor:
            size = m.itemsize
            n = m.nbytes // size
            view = self._typed[dtype][off // size : off // size + n]
            return view if len(shape) == 1 else view.view(shape)

        return self._views.get((m.format, off, m.shape), make)


class UploadLaunch:
    """The slotted staging's upload (``ops/kernels/staged_upload.py``) bound to its tensors: a prelude launch."""

    __slots__ = ("args", "grid", "key")

    def __init__(self, slots: torch.Tensor, device_words: torch.Tensor, seq: torch.Tensor) -> None:
        self.args = (slots, device_words, seq, int(slots.shape[1]))
        self.grid = (-(-device_words.numel() // UPLOAD_BLOCK),)
        self.key: tuple[object, ...] = (*(t.data_ptr() for t in (slots, device_words, seq)), *self.args[3:], self.grid)

    def run(self) -> None:
        from kvcanary.ops.kernels.staged_upload import staged_upload_kernel

        staged_upload_kernel[self.grid](*self.args, HEAD_WORDS=HEAD_WORDS, NUM_SLOTS=NUM_SLOTS, BLOCK=UPLOAD_BLOCK)


def upload_reference(slots: torch.Tensor, device_words: torch.Tensor, seq: torch.Tensor) -> None:
    """The upload kernel's spec: slot ``seq % NUM_SLOTS``'s words, as many as its header says, to the device."""
    slot = int(seq[0]) % NUM_SLOTS
    n = int(slots[slot, 0])
    device_words[:n] = slots[slot, HEAD_WORDS : HEAD_WORDS + n]


class Pack:
    """Host arrays laid out for one :meth:`Staging.send` as they are added (each checked once, at an
    :data:`ALIGN`-byte offset); :meth:`add` returns the index of the array's device view."""

    __slots__ = ("end", "mems", "offsets")

    def __init__(self, arrays: Sequence[HostArray | memoryview] = ()) -> None:
        self.mems: list[memoryview] = []
        self.offsets: list[int] = []
        self.end = 0
        for a in arrays:
            self.add(a)

    def add(self, a: HostArray | memoryview) -> int:
        m = _bytes_of(a)
        self.mems.append(m)
        self.offsets.append(self.end)
        self.end += aligned(m.nbytes)
        return len(self.mems) - 1


def aligned(nbytes: int) -> int:
    """The bytes an array of ``nbytes`` takes in a pack: rounded up to :data:`ALIGN`."""
    return -(-nbytes // ALIGN) * ALIGN


def _bytes_of(a: HostArray | memoryview) -> memoryview:
    """``a``'s memory, contiguous, after checking its type."""
    if isinstance(a, memoryview) and a.c_contiguous:
        return a
    m = a.data if isinstance(a, np.ndarray) else memoryview(a)
    if (m.format, m.itemsize) not in _TORCH_DTYPES:
        raise TypeError(f"arrays must be int64, int32 or bool, got {getattr(a, 'dtype', m.format)}")
    if not m.c_contiguous:
        m = np.ascontiguousarray(a).data
    return m
