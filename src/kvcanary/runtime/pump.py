"""The lagged device-to-host pump: each host step copies the outbox into one of two host buffers.

Host step k enqueues an asynchronous copy of the outbox into host buffer ``k % 2`` (pinned memory on
CUDA, an ordinary copy on CPU) and records an event; host step k + 1 waits on step k's event (long
done in a serving loop, which synchronises on its sampled tokens anyway) and decodes step k.  Two
buffers, so the copy of step k + 1 never overwrites the buffer being decoded.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import numpy.typing as npt
import torch

from kvcanary.runtime.buffers import Layout
from kvcanary.schema import NUM_COUNTERS
from kvcanary.workspace import ViolationLog


@dataclasses.dataclass
class HostBuffer:
    """One host copy of the outbox, with views for decoding it."""

    tensor: torch.Tensor
    flat: npt.NDArray[np.int64]  # numpy view of ``tensor``: cheap scalar reads
    totals: npt.NDArray[np.int64]  # [G, NUM_COUNTERS]
    logs: list[ViolationLog]  # the snapshot's per-group logs (host views)
    event: torch.cuda.Event | None
    step: int = -1
    request_ids: tuple[object, ...] | None = None

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class LaggedPump:
    def __init__(self, outbox: torch.Tensor, layout: Layout) -> None:
        self._outbox = outbox
        self._cuda = outbox.device.type == "cuda"
        self.phase_offset = layout.phase_offset
        self.buffers = [self._allocate(layout) for _ in range(2)]
        self._pending: HostBuffer | None = None

    def _allocate(self, layout: Layout) -> HostBuffer:
        t = torch.zeros(layout.outbox_size, dtype=torch.int64, pin_memory=self._cuda)
        flat = t.numpy()
        totals = flat[layout.totals_offset : layout.phase_offset].reshape(layout.num_groups, NUM_COUNTERS)
        event = torch.cuda.Event() if self._cuda else None  # type: ignore[no-untyped-call]
        return HostBuffer(tensor=t, flat=flat, totals=totals, logs=layout.logs(t), event=event)

    def stage(self, step: int, request_ids: tuple[object, ...] | None) -> HostBuffer | None:
        """Start copying step ``step``'s outbox; return the previous step's buffer (not yet waited on)."""
        buf = self.buffers[step & 1]
        buf.tensor.copy_(self._outbox, non_blocking=self._cuda)
        if buf.event is not None:
            buf.event.record()
        buf.step = step
        buf.request_ids = request_ids
        prev, self._pending = self._pending, buf
        return prev

    def take(self) -> HostBuffer | None:
        """The staged buffer not yet decoded (for a final drain), and forget it."""
        prev, self._pending = self._pending, None
        return prev
