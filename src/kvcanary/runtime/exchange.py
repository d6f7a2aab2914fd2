"""The verdict exchange between ranks: one small fixed-size all_reduce per host step, awaited a step later.

Every rank writes one row ``(host step, violation rows, failed checks of each kind in
HEALTH_CHECKS)`` into a zeroed ``[world, 2 + len(HEALTH_CHECKS)]`` int64 tensor and all-reduces it
(sum) asynchronously.  The row of a clean rank is ``(step, 0, 0, ...)``, so after the reduce every
rank holds every rank's row: a clean step is one collective that completed while the engine ran its
next step, and one check of a small array.  Health failures travel as counts in the row itself;
only when some rank found violations do the ranks exchange their reports
(:meth:`VerdictExchange.gather_bytes`, a synchronous slow path).

The collective is started with the process group's own ``allreduce`` (sum is its default).  Waits
are bounded: gloo's ``Work.wait(timeout)`` on CPU; on CUDA the collective's completion is
copied to pinned host memory behind an event that is polled until the deadline (NCCL's own wait
only orders streams).  A dead or stuck peer becomes :class:`CanaryPeerError`, never a hang.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist

_POLL_S = 20e-6  # how long a CUDA wait sleeps between event queries (the event is normally done already)
HEALTH_CHECKS: tuple[str, ...] = ("kernels_ran", "phase")  # the manager's checks, in the row's order
_WIDTH = 2 + len(HEALTH_CHECKS)


class CanaryPeerError(RuntimeError):
    """A peer rank did not take part in the verdict exchange in time (dead or stuck), or is out of step."""


@dataclasses.dataclass(frozen=True)
class Findings:
    """What the ranks found at one exchange: the ranks with violations, and each failing rank's checks."""

    violation_ranks: tuple[int, ...] = ()
    health: Mapping[int, Mapping[str, int]] = dataclasses.field(default_factory=dict)  # rank -> check -> count

    def __bool__(self) -> bool:
        return bool(self.violation_ranks or self.health)


CLEAN = Findings()


class VerdictExchange:
    """The per-step collective of one rank in ``group`` (tensors on ``device``: CPU for gloo, CUDA for NCCL)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, timeout_s: float) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.timeout_s = timeout_s
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._cuda = device.type == "cuda"
        self._device = device
        # Host staging of this rank's row; on CUDA pinned, so the copies in and out are asynchronous.
        self._stage = torch.zeros(self.world, _WIDTH, dtype=torch.int64, pin_memory=self._cuda)
        self._stage_np: npt.NDArray[np.int64] = self._stage.numpy()
        self._flags = (
            self._stage if not self._cuda else torch.zeros(self.world, _WIDTH, dtype=torch.int64, device=device)
        )
        self._result = self._stage if not self._cuda else torch.zeros_like(self._stage).pin_memory()
        self._result_np: npt.NDArray[np.int64] = self._result.numpy()
        self._event = torch.cuda.Event() if self._cuda else None  # type: ignore[no-untyped-call]
        self._work: dist.Work | None = None
        self._step = -1

    @property
    def step(self) -> int:
        """The step marker of the exchange started last."""
        return self._step

    @property
    def pending(self) -> bool:
        return self._work is not None

    def start(self, step: int, rows: int, health: Sequence[int] = ()) -> None:
        """All-reduce this rank's ``(step, rows, *health)`` asynchronously (the previous exchange must be finished).

        ``health``: this step's failed checks, one count per :data:`HEALTH_CHECKS` entry (empty: none)."""
        if self._work is not None:
            raise RuntimeError("VerdictExchange.start: the previous exchange was not finished")
        self._stage_np.fill(0)
        self._stage_np[self.rank, 0] = step
        self._stage_np[self.rank, 1] = rows
        if health:
            self._stage_np[self.rank, 2:] = health
        if self._cuda:
            self._flags.copy_(self._stage, non_blocking=True)
        # The group's own method: dist.all_reduce's Python checks cost more than the collective's start.
        work = self.group.allreduce([self._flags])
        if self._cuda:
            assert self._event is not None
            work.wait()  # NCCL: the current stream waits for the collective; the host does not
            self._result.copy_(self._flags, non_blocking=True)
            self._event.record()
        self._work = work
        self._step = step

    def finish(self) -> Findings:
        """What the ranks found in the pending exchange (:data:`CLEAN`, falsy, on a clean step)."""
        work, self._work = self._work, None
        if work is None:
            raise RuntimeError("VerdictExchange.finish: no exchange is pending")
        self._await(work, self._event, f"the verdict exchange of host step {self._step}")
        rows = self._result_np.tolist()  # a few Python ints: cheaper than numpy reductions at this size
        if any(row[0] != self._step for row in rows):
            at = ", ".join(f"rank {r}: {row[0]}" for r, row in enumerate(rows))
            raise CanaryPeerError(
                f"kvcanary: ranks are out of step at the verdict exchange (host step per rank: {at}); every "
                "rank must call host_step/flush the same number of times with the same canary mode"
            )
        if not any(any(row[1:]) for row in rows):
            return CLEAN
        health = {
            r: {check: n for check, n in zip(HEALTH_CHECKS, row[2:], strict=True) if n}
            for r, row in enumerate(rows)
            if any(row[2:])
        }
        return Findings(tuple(r for r, row in enumerate(rows) if row[1]), health)

    def gather_bytes(self, payload: bytes, what: str) -> list[bytes]:
        """Every rank's ``payload`` in rank order (the slow path: synchronous, still time-limited)."""
        sizes = torch.zeros(self.world, dtype=torch.int64)
        sizes[self.rank] = len(payload)
        sizes = self._reduce_now(sizes, f"{what} (sizes)")
        buf = torch.zeros(self.world, int(sizes.max()), dtype=torch.uint8)
        buf[self.rank, : len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        buf = self._reduce_now(buf, what)
        return [buf[r, : int(sizes[r])].numpy().tobytes() for r in range(self.world)]

    def _reduce_now(self, host: torch.Tensor, what: str) -> torch.Tensor:
        t = host.to(self._device) if self._cuda else host
        work = self.group.allreduce([t])
        event = None
        if self._cuda:
            work.wait()
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
        self._await(work, event, what)
        return t.cpu()

    def _await(self, work: dist.Work, event: torch.cuda.Event | None, what: str) -> None:
        try:
            if event is None:
                # A completed collective's plain wait is cheap (and raises if it failed); only a pending one
                # needs the bounded wait, which costs more.
                work.wait() if work.is_completed() else work.wait(timeout=self._timeout)
                return
            deadline = time.monotonic() + self.timeout_s
            while not event.query():  # type: ignore[no-untyped-call]
                if time.monotonic() > deadline:
                    raise TimeoutError("the collective did not complete")
                time.sleep(_POLL_S)
        except (RuntimeError, TimeoutError) as exc:
            raise CanaryPeerError(
                f"kvcanary: {what} did not complete within {self.timeout_s:g} s on rank {self.rank} of "
                f"{self.world}: a peer rank is dead or stuck, so this rank stops instead of waiting ({exc})"
            ) from exc
