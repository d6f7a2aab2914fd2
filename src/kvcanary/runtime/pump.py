"""The lagged device-to-host pump: each host step copies the outbox into one of two host buffers.

Host step k first decodes step k - 1 (waiting on its event: long done in a serving loop, which
synchronises on its sampled tokens anyway), then enqueues an asynchronous copy of the outbox into
host buffer ``k % 2`` (pinned memory on CUDA, an ordinary copy on CPU) and records an event.  Two
buffers, so step k's copy never lands in the buffer just decoded: the manager keeps reading its
totals (as of step k - 1) until the next decode, without copying them.
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

    def stage(self, step: int, request_ids: tuple[object, ...] | None) -> None:
        """Start copying step ``step``'s outbox (the previous staged buffer must have been taken)."""
        buf = self.buffers[step & 1]
        buf.tensor.copy_(self._outbox, non_blocking=self._cuda)
        if buf.event is not None:
            buf.event.record()
        buf.step = step
        buf.request_ids = request_ids
        self._pending = buf

    def take(self) -> HostBuffer | None:
        """The staged buffer not yet decoded (not waited on), and forget it."""
        prev, self._pending = self._pending, None
        return prev
