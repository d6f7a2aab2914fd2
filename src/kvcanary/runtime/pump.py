"""The lagged device-to-host pump: each host step copies the outbox into one of three host buffers.

Host step k enqueues an asynchronous copy of the outbox into host buffer ``k % 3`` (pinned memory on
CUDA, an ordinary copy on CPU) and records an event on the current stream -- the engine's compute
stream, behind the canary's work.  Decoding runs at most two steps behind and never waits on the clean
path: before staging step k, host step k decodes the oldest step not yet decoded when

* its event has completed (polled with ``Event.query``, no wait): normally step k - 1, reported at k; or
* it is step k - 2 or older: it must be decoded now (waiting on its event if it has not completed, which
  in a serving loop it has: the engine synchronised on step k - 1's tokens since), so that staging never
  runs more than two steps ahead of decoding.

At most one step is decoded per host step, so each host step returns at most one step's report, and
steps are decoded in order, each exactly once.  Three buffers: after step k is staged, the steps not yet
decoded are among k - 1 and k, and the last one decoded is at least k - 2; those three buffers are
distinct, so a copy never lands in a buffer still to be decoded or in the one the decoder keeps reading
its totals from (as of the last decoded step, without copying them).

On CPU there is no event: every copy has landed when it is taken, so step k - 1 is always decoded by
host step k.

With a publisher (:mod:`.publish`) the device work of host step k writes the outbox into buffer ``k % 4`` itself
and sets that buffer's flag: the host step makes no copy and records no event, and "landed" is a read of the flag.
The step's work publishes inside the canary's step graph (:meth:`LaggedPump.publish_for`); a host step whose
forward did not publish launches the publish itself when it stages.  Four buffers then: the publish is queued before
its host step decodes (see :data:`.publish.NUM_BUFFERS`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt
import torch

from kvcanary.runtime.buffers import Layout
from kvcanary.runtime.cuda_calls import CudaCalls, Transfer, device_index
from kvcanary.runtime.publish import NUM_BUFFERS as PUBLISH_BUFFERS
from kvcanary.runtime.publish import OutboxPublisher
from kvcanary.schema import NUM_COUNTERS
from kvcanary.workspace import ViolationLog

logger = logging.getLogger("kvcanary")

NUM_BUFFERS = 3
QUERY_EVERY = 64  # a publish waited for: its flag is read on every poll, the stream asked every this many polls
MAX_LAG = NUM_BUFFERS - 1  # steps a decode may trail the host step that takes it


class CopyFence:
    """How far one pump's copies are known to have run, for other copies queued on the same stream (the staging's of
    the transformers translation): a copy queued before host step ``s``'s outbox copy has run once ``landed >= s``
    (the stream runs in order), so it needs no event of its own.  ``next_step``: the host step whose copy is queued
    next.  ``seq``: with a publisher, its device counter of publishes (``[seq, ticket]``; see :mod:`.publish`), which
    is the index of the host step whose device work runs (the staging's slotted mode reads it).  Plain attributes:
    read on every step, with the caches cold."""

    __slots__ = ("landed", "next_step", "seq")

    def __init__(self) -> None:
        self.landed = -1
        self.next_step = 0
        self.seq: torch.Tensor | None = None


@dataclasses.dataclass
class HostBuffer:
    """One host copy of the outbox, with views for decoding it."""

    tensor: torch.Tensor
    flat: npt.NDArray[np.int64]  # numpy view of ``tensor``
    words: Sequence[int]  # a memoryview of the memory as int64 words: the cheapest scalar reads (no numpy call)
    totals: npt.NDArray[np.int64]  # [G, NUM_COUNTERS]
    logs: list[ViolationLog]  # the snapshot's per-group logs (host views)
    copy: Callable[[], object]  # the outbox into ``tensor``: CPU (landed when it returns)
    transfer: Transfer | None  # CUDA: the asynchronous copy and the event behind it
    step: int = -1
    request_ids: tuple[object, ...] | None = None
    known_landed: bool = False  # the copy was seen complete: no second call to the device for it
    flags: Sequence[int] | None = None  # published (see .publish): a memoryview of every buffer's flags
    slot: int = 0
    catch_up: Callable[[HostBuffer], None] | None = None  # published: waits for the device, when the flag is not set

    def landed(self) -> bool:
        """Whether the copy has completed (never waits)."""
        if not self.known_landed:
            flags = self.flags
            if flags is not None:
                self.known_landed = flags[self.slot] == self.step + 1
            else:
                self.known_landed = self.transfer is None or self.transfer.landed()
        return self.known_landed

    def wait(self) -> None:
        if not self.known_landed:
            if self.catch_up is not None:
                self.catch_up(self)
            elif self.transfer is not None:
                self.transfer.wait()
        self.known_landed = True


class LaggedPump:
    def __init__(self, outbox: torch.Tensor, layout: Layout, *, publish: bool = False) -> None:
        """``publish``: the device work publishes the outbox (see :mod:`.publish`; needs the Triton kernels)."""
        self._outbox = outbox
        self._cuda = outbox.device.type == "cuda"
        self._outbox_bytes = outbox.nbytes
        self.phase_offset = layout.phase_offset
        self.publisher: OutboxPublisher | None = None
        self.published_step = -1  # the host step whose device work published already (see publish_for)
        self.publish_misses = 0  # host steps whose publish never landed (see _catch_up): none on a working device
        if publish:
            size = (PUBLISH_BUFFERS, layout.outbox_size)
            block = torch.zeros(size, dtype=torch.int64, pin_memory=self._cuda)
            self._flags = torch.zeros(PUBLISH_BUFFERS, dtype=torch.int64, pin_memory=self._cuda)
            self.publisher = OutboxPublisher(outbox, block, self._flags)
            flags = self._flags.numpy().data
            self._calls = None
            self.buffers = [self._allocate(layout, block[i], flags, i) for i in range(PUBLISH_BUFFERS)]
        else:
            self._calls = CudaCalls(device_index(outbox.device)) if self._cuda else None
            self.buffers = [self._allocate(layout) for _ in range(NUM_BUFFERS)]
        self._pending: collections.deque[HostBuffer] = collections.deque()  # staged, not yet taken, oldest first
        self.fence = CopyFence()
        if self.publisher is not None:
            self.fence.seq = self.publisher.state

    def _allocate(
        self, layout: Layout, t: torch.Tensor | None = None, flags: Sequence[int] | None = None, slot: int = 0
    ) -> HostBuffer:
        """A host buffer: its own (pinned on CUDA), or ``t``, buffer ``slot`` of a publisher's block."""
        if t is None:
            t = torch.zeros(layout.outbox_size, dtype=torch.int64, pin_memory=self._cuda)
        flat = t.numpy()
        totals = flat[layout.totals_offset : layout.phase_offset].reshape(layout.num_groups, NUM_COUNTERS)
        copy = functools.partial(t.copy_, self._outbox)  # CPU: a plain copy, landed when taken
        transfer = None if self._calls is None else self._calls.download(t, self._outbox)
        logs = layout.logs(t)
        catch_up = None if flags is None else self._catch_up
        return HostBuffer(
            tensor=t, flat=flat, words=flat.data, totals=totals, logs=logs, copy=copy, transfer=transfer,
            flags=flags, slot=slot, catch_up=catch_up,
        )  # fmt: skip

    def publish_for(self, step: int) -> Callable[[], None] | None:
        """The publish launch for host step ``step``'s device work to end with (the caller then sets
        :attr:`published_step`), or None: no publisher, or the step published already (a second forward)."""
        if self.publisher is None or self.published_step == step:
            return None
        return self.publisher.launch

    def _catch_up(self, buf: HostBuffer) -> None:
        """Wait for ``buf``'s publish: poll its flag until it lands, or until the current stream (the one the host
        steps queue their work on) has run everything queued on it.  Not a device synchronisation first: that would
        also wait for the forwards queued after the step (a device running behind a graphed engine; the issue 14
        workload's graphed runs spent 26-42 ms a host step that way).  A publish that
        never landed (the device skipped it: nothing here does) is replaced by a copy of the outbox as it is now,
        counted and logged, and the publishes realigned with the host steps."""
        stream = torch.cuda.current_stream(self._outbox.device) if self._cuda else None
        polls = 0
        while not buf.landed():
            if stream is None or (polls % QUERY_EVERY == 0 and stream.query()):
                break
            polls += 1
            time.sleep(0)  # yields, the GIL released, and wakes at once: a timed sleep's slack is ~50 us on Linux
        if buf.landed():
            return
        if self._cuda:  # queued on another stream than this host step's: every stream's work done first
            torch.cuda.synchronize(self._outbox.device)
            if buf.landed():
                return
        self.publish_misses += 1
        if self.publish_misses == 1:
            logger.error("kvcanary: the outbox of host step %d was never published; copied instead", buf.step)
        buf.tensor.copy_(self._outbox)
        assert self.publisher is not None  # only a publisher's buffers catch up
        self.publisher.state[0] = self.fence.next_step  # the next publish is the next host step's

    @property
    def pending_steps(self) -> tuple[int, ...]:
        """Steps staged and not yet taken, oldest first."""
        return tuple(b.step for b in self._pending)

    def stage(self, step: int, request_ids: tuple[object, ...] | None) -> None:
        """Start copying step ``step``'s outbox; steps up to ``step - MAX_LAG`` must have been taken."""
        if self._pending and self._pending[0].step <= step - MAX_LAG:
            raise RuntimeError(f"step {self._pending[0].step} was not decoded before staging step {step}")
        buf = self.buffers[step % len(self.buffers)]
        buf.known_landed = False
        if self.publisher is not None:
            if self.published_step != step:
                self.publisher.launch()
        elif buf.transfer is None:
            buf.copy()
        else:
            buf.transfer.send(self._outbox_bytes)
        buf.step = step
        buf.request_ids = request_ids
        self._pending.append(buf)
        self.fence.next_step = step + 1

    def take_due(self, step: int) -> HostBuffer | None:
        """For host step ``step``: the oldest staged buffer if its copy has landed or it is ``MAX_LAG`` or more
        steps old (then the decoder waits on it), else None; at most one a call."""
        if not self._pending:
            return None
        oldest = self._pending[0]
        if oldest.step > step - MAX_LAG and not oldest.landed():
            return None
        self.fence.landed = oldest.step  # the caller decodes it now, waiting for it if it has not landed
        return self._pending.popleft()

    def take_all(self) -> list[HostBuffer]:
        """Every staged buffer not yet taken, oldest first (the end of a run: the caller waits for each)."""
        out = list(self._pending)
        self._pending.clear()
        if out:
            self.fence.landed = out[-1].step
        return out
