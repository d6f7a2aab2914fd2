"""The manager's device buffers and the per-step device work around the model forward.

Two flat int64 device tensors, allocated once:

* ``live``: every group's violation log (first K rows, last K rows) followed by every group's
  counters ``[G, NUM_COUNTERS]``.  The kernels/reference append to it during ``before``.
* ``outbox``: ``snapshot`` (a copy of ``live``, taken by ``after``), then ``totals``
  ``[G, NUM_COUNTERS]`` (counters summed over all forwards since install), then ``phase``
  ``[before_count, after_count]``.  One device-to-host copy of ``outbox`` per host step carries
  everything the host needs.

``after`` snapshots and clears the live log on device, so the whole per-step device work is the group
kernels (the first of which also counts the before-forward phase mark) and the step's close (one launch on
the kernel path on CUDA, :mod:`kvcanary.ops.kernels.step_close`; four torch ops elsewhere):
graph-capturable, nothing allocated, nothing read back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from kvcanary.batch import StepBatch
from kvcanary.canary import GroupCanary
from kvcanary.digest_canary import GroupDigest
from kvcanary.schema import NUM_COUNTERS, ROW_WIDTH
from kvcanary.workspace import ViolationLog

if TYPE_CHECKING:
    from kvcanary.runtime.step_graphs import Prelude

PHASE_BEFORE = 0
PHASE_AFTER = 1


class Layout:
    """Offsets of each group's log inside ``live`` (and its copy, the snapshot)."""

    def __init__(self, log_rows: Sequence[int]) -> None:
        self.log_rows = tuple(log_rows)
        self.num_groups = len(self.log_rows)
        self.row_offsets: list[int] = []
        off = 0
        for k in self.log_rows:
            self.row_offsets.append(off)
            off += 2 * k * ROW_WIDTH
        self.counters_offset = off
        self.live_size = off + self.num_groups * NUM_COUNTERS
        self.totals_offset = self.live_size
        self.phase_offset = self.totals_offset + self.num_groups * NUM_COUNTERS
        self.outbox_size = self.phase_offset + 2

    def logs(self, flat: torch.Tensor) -> list[ViolationLog]:
        """Views of each group's log inside ``flat`` (``live``, a snapshot, or a host copy)."""
        counters = self.counters(flat)
        out = []
        for g, (off, k) in enumerate(zip(self.row_offsets, self.log_rows, strict=True)):
            first = flat[off : off + k * ROW_WIDTH].view(k, ROW_WIDTH)
            last = flat[off + k * ROW_WIDTH : off + 2 * k * ROW_WIDTH].view(k, ROW_WIDTH)
            out.append(ViolationLog(first=first, last=last, counters=counters[g]))
        return out

    def counters(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.counters_offset : self.live_size].view(self.num_groups, NUM_COUNTERS)

    def totals(self, outbox: torch.Tensor) -> torch.Tensor:
        return outbox[self.totals_offset : self.phase_offset].view(self.num_groups, NUM_COUNTERS)

    def phase(self, outbox: torch.Tensor) -> torch.Tensor:
        return outbox[self.phase_offset : self.outbox_size]


class StepWork:
    """The device work of one forward: ``before`` (phase mark, plan/verify/stamp), ``after`` (snapshot)."""

    CLOSE_BLOCK = 1024  # words of ``live`` per program of the close kernel

    def __init__(
        self, canaries: Sequence[GroupCanary], layout: Layout, device: torch.device, *, close_kernel: bool = False
    ) -> None:
        """``close_kernel``: end each step with one launch (the kernel path on CUDA) instead of four torch ops."""
        self.canaries = tuple(canaries)
        # The KV digest of each group, when attached: verified and stamped in one call after the forward,
        # or (an adapter that stamps itself, GroupDigest.stamp_after_forward False) verified after the plan.
        self.digests: list[GroupDigest | None] = [None] * len(self.canaries)
        self._batches: Sequence[StepBatch] = ()
        self.layout = layout
        self.live = torch.zeros(layout.live_size, dtype=torch.int64, device=device)
        self.outbox = torch.zeros(layout.outbox_size, dtype=torch.int64, device=device)
        self.logs = layout.logs(self.live)
        self._live_counters = layout.counters(self.live)
        self._snapshot = self.outbox[: layout.live_size]
        self._totals = layout.totals(self.outbox)
        phase = layout.phase(self.outbox)
        self._phase_before = phase[PHASE_BEFORE : PHASE_BEFORE + 1]
        self._phase_after = phase[PHASE_AFTER : PHASE_AFTER + 1]
        self._close = self._close_kernel() if close_kernel else self._close_ops

    def before(self, batches: Sequence[StepBatch]) -> None:
        """Batches in group order, already validated by the caller: each group's batch is validated once a
        step, the canary and its launchers do not repeat the checks.  The before-forward phase mark is counted
        by the first group's first launch (a launch fewer a step); by a torch op only when there is no group."""
        if not self.canaries:
            self._phase_before.add_(1)
        mark: torch.Tensor | None = self._phase_before
        for canary, digest, log, batch in zip(self.canaries, self.digests, self.logs, batches, strict=True):
            canary.step(batch, log, validated=True, mark=mark)
            mark = None
            if digest is not None and not digest.stamp_after_forward:
                digest.verify(batch, log)
        self._batches = batches

    def after(self) -> None:
        for digest, log, batch in zip(self.digests, self.logs, self._batches, strict=True):
            if digest is not None and digest.stamp_after_forward:
                digest.verify_and_stamp(batch, log)  # the forward has written this step's K/V
        self._batches = ()
        self.close()

    def bound(
        self, batches: Sequence[StepBatch], prelude: Prelude | None = None, publish: Callable[[], None] | None = None
    ) -> Callable[[], None]:
        """One step's whole device work as one call (what a step graph captures): ``prelude`` (the adapter's work
        that fills ``batches``), :meth:`before` and :meth:`after` on ``batches`` (validated by the caller), then
        ``publish`` (the outbox's, see :mod:`.publish`)."""

        def step_work() -> None:
            if prelude is not None:
                prelude.run()
            self.before(batches)
            self.after()
            if publish is not None:
                publish()

        return step_work

    def close(self) -> None:
        """The step's close: snapshot the live log and counters, add the counters to the totals, clear the live
        log, bump the after-forward phase mark (the last part of :meth:`after`)."""
        self._close()

    def _close_ops(self) -> None:
        """The step's close as torch ops (the close kernel's spec)."""
        self._snapshot.copy_(self.live)
        self._totals.add_(self._live_counters)
        self.live.zero_()
        self._phase_after.add_(1)

    def _close_kernel(self) -> Callable[[], None]:
        """The step's close as one launch, its arguments bound once."""
        from kvcanary.ops.kernels.step_close import step_close_kernel

        lay = self.layout
        launch = step_close_kernel[(-(-lay.live_size // self.CLOSE_BLOCK),)]
        args = (self.live, self.outbox, lay.live_size, lay.counters_offset, lay.totals_offset)
        return functools.partial(launch, *args, lay.phase_offset + PHASE_AFTER, BLOCK=self.CLOSE_BLOCK)
