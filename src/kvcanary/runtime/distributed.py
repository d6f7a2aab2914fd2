"""Several ranks, one verdict: a rank-aware wrapper around each rank's :class:`CanaryManager`.

With tensor parallelism every rank checks its shard behind the same tables; with pipeline
parallelism each stage checks its own layers' pool.  A canary that acts alone would abort a request
on one rank while the others wait for it forever, or raise on one rank and leave the others hung in
the engine's next collective.  :class:`DistributedCanary` runs each rank's manager as usual (in
``log`` mode, so it never acts alone), combines the ranks' findings per step through
``torch.distributed`` on the process group the engine passes in (the canary never creates its own
world), and then acts by the configured mode identically on every rank.

Timing, per host step N (see :mod:`kvcanary.runtime.exchange`): the manager decodes step N - 1,
the wrapper finishes the exchange started at host step N - ``lag`` (it completed while the engine
ran), starts the exchange of this call's finding, and acts.  A violation of step k is therefore
acted upon at host step k + 1 + ``lag`` on every rank (``lag`` steps more than a single canary); a
clean step costs one small asynchronous all_reduce and no extra host synchronisation.  ``lag`` 1
suits tensor parallelism; with pipeline parallelism a lag of the number of stages lets each stage's
exchange complete while the later stages catch up.

All ranks must use the same mode and call ``host_step``/``flush`` the same number of times (checked:
ranks out of step raise :class:`CanaryPeerError`).  Failed health checks (kernels that did not run, a
graph without the canary's work) travel in the same exchange, as counts per check: every rank's
verdict names the failing ranks, and in ``raise`` mode every rank raises :class:`RankedHealthError`
at the same call (a violation wins over a failed check, as for one rank).  A health failure names no
request, so ``fail-request`` only logs it, on every rank.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import pickle
import time
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from kvcanary.batch import StepBatch
from kvcanary.config import CanaryConfig, Mode
from kvcanary.layout import CanaryGroup
from kvcanary.ops import Backend
from kvcanary.runtime.checks import RateLimiter
from kvcanary.runtime.exchange import HEALTH_CHECKS, CanaryPeerError, VerdictExchange
from kvcanary.runtime.manager import CanaryManager
from kvcanary.runtime.report import StepReport, affected
from kvcanary.runtime.verdict import (
    DistributedFailRequestCallback,
    RankedHealthError,
    RankedViolation,
    RankVerdict,
    merge_reports,
    portable_bytes,
)
from kvcanary.workspace import Capacities

logger = logging.getLogger("kvcanary")

__all__ = [
    "CanaryPeerError",
    "DistributedCanary",
    "DistributedFailRequestCallback",
    "RankVerdict",
    "RankedHealthError",
    "RankedViolation",
]


class DistributedCanary:
    """One rank's canary that reports, and acts, in agreement with every rank of ``process_group``.

    ``manager`` is this rank's :class:`CanaryManager`, configured in ``log`` mode (or ``off``); the
    mode to act by is ``mode``.  ``timeout_s`` bounds every wait on a peer.  ``exchange_every`` > 1
    exchanges once per that many host steps, for the findings of all of them (one verdict per window,
    each rank's reports merged): the clean path's cost is divided by it, a finding is acted on up to
    ``exchange_every - 1`` steps later.
    """

    def __init__(
        self,
        manager: CanaryManager,
        process_group: dist.ProcessGroup,
        mode: Mode,
        on_fail_request: DistributedFailRequestCallback | None = None,
        *,
        timeout_s: float = 60.0,
        lag: int = 1,
        exchange_every: int = 1,
        device: torch.device | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        _check_modes(manager, mode, on_fail_request)
        _check_exchange(process_group, timeout_s, lag, exchange_every)
        self.manager = manager
        self.mode = mode
        self.on_fail_request = on_fail_request
        self._enabled = mode is not Mode.OFF
        self._calls = 0  # host_step/flush calls so far: the exchange's step marker
        self._health_seen = self._health_counts()
        self.lag = lag
        self.exchange_every = exchange_every
        # The window of host steps not exchanged yet: this rank's reports and failed checks in it.
        self._window: list[StepReport] = []
        self._window_health: tuple[int, ...] = ()
        self._window_calls = 0
        self._started = 0  # exchanges started so far
        # Exchanges started and not yet finished, oldest first, with this rank's finding of each.
        self._in_flight: collections.deque[tuple[VerdictExchange, StepReport | None]] = collections.deque()
        self._limiter = RateLimiter(manager.config.log_rate_limit_per_s, clock)
        if device is None:
            nccl = dist.get_backend(process_group) == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self._exchanges = [VerdictExchange(process_group, device, timeout_s) for _ in range(lag)]

    @classmethod
    def create(
        cls,
        groups: Sequence[CanaryGroup],
        caps: Capacities | Mapping[str, Capacities],
        config: CanaryConfig,
        process_group: dist.ProcessGroup,
        device: torch.device | str = "cpu",
        backend: Backend = Backend.AUTO,
        on_fail_request: DistributedFailRequestCallback | None = None,
        *,
        timeout_s: float = 60.0,
        lag: int = 1,
        exchange_every: int = 1,
    ) -> DistributedCanary:
        """This rank's manager (built in log mode) wrapped to act by ``config.mode`` with every rank."""
        inner = config if config.mode is Mode.OFF else dataclasses.replace(config, mode=Mode.LOG)
        manager = CanaryManager(groups, caps, inner, device, backend)
        return cls(
            manager, process_group, config.mode, on_fail_request,
            timeout_s=timeout_s, lag=lag, exchange_every=exchange_every,
        )  # fmt: skip

    @property
    def rank(self) -> int:
        return self._exchanges[0].rank

    @property
    def in_flight(self) -> int:
        """Exchanges started and not yet finished (at most ``lag``)."""
        return len(self._in_flight)

    # ------------------------------------------------------------------ the manager's device side, as is

    def before_forward(self, batches: Mapping[str, StepBatch]) -> None:
        self.manager.before_forward(batches)

    def after_forward(self) -> None:
        self.manager.after_forward()

    def abandon_forward(self) -> None:
        self.manager.abandon_forward()

    # ------------------------------------------------------------------ host side

    def host_step(self, request_ids: Sequence[object] | None = None) -> RankVerdict | None:
        """This rank's manager step, then the lagged exchange; returns (or raises) the common verdict."""
        if not self._enabled:
            return None
        self._collect(self.manager.host_step(request_ids))
        if self._window_calls < self.exchange_every:
            return None
        verdict = self._finish() if len(self._in_flight) == self.lag else None
        self._start()
        return self._act(verdict)

    def flush(self) -> list[RankVerdict]:
        """End of a run: act on the exchanges in flight, then on the manager's last step (synchronously)."""
        if not self._enabled:
            return []
        self._collect(self.manager.flush())
        out = []
        while self._in_flight:
            out.append(self._act(self._finish()))
        self._start()
        out.append(self._act(self._finish()))
        return [v for v in out if v is not None]

    def close(self) -> None:
        self.manager.close()

    def _health_counts(self) -> tuple[int, ...]:
        counts = self.manager.health_failure_counts()
        return tuple(counts[check] for check in HEALTH_CHECKS)

    def _health_delta(self) -> tuple[int, ...]:
        """This call's failed checks, per check (empty when none: the clean path writes nothing)."""
        now = self._health_counts()
        if now == self._health_seen:
            return ()
        delta, self._health_seen = tuple(a - b for a, b in zip(now, self._health_seen, strict=True)), now
        return delta

    def _collect(self, local: StepReport | None) -> None:
        """Add one host step's findings to the window (the clean path: a counter and one comparison)."""
        self._calls += 1
        self._window_calls += 1
        if local is not None:
            self._window.append(local)
        health = self._health_delta()
        if health:
            prior = self._window_health or (0,) * len(health)
            self._window_health = tuple(a + b for a, b in zip(prior, health, strict=True))

    def _start(self) -> None:
        """Exchange the window's findings (marker: this call's index) and open a new window."""
        local = merge_reports(self._window) if self._window else None
        rows = 0 if local is None else max(local.total, 1)
        # Free by construction: the ones in flight started at the previous lag - 1 exchanges.
        exchange = self._exchanges[self._started % self.lag]
        exchange.start(self._calls - 1, rows, self._window_health)
        self._in_flight.append((exchange, local))
        self._started += 1
        self._window, self._window_health, self._window_calls = [], (), 0

    def _finish(self) -> RankVerdict | None:
        if not self._in_flight:
            return None
        exchange, local = self._in_flight.popleft()
        found = exchange.finish()
        if not found:  # the clean path ends here
            return None
        reports: dict[int, StepReport] = {}
        if found.violation_ranks:
            ranks = list(found.violation_ranks)
            mine = local if self.rank in ranks else None
            payloads = exchange.gather_bytes(portable_bytes(mine), f"the report exchange of rank(s) {ranks}")
            # Peers' reports come pickled from the same job; this rank keeps its own (unpickled ids intact).
            reports = {r: mine if r == self.rank and mine is not None else pickle.loads(payloads[r]) for r in ranks}
        violations = [v for r in sorted(reports) for v in reports[r].violations]
        return RankVerdict(
            # with reports: their earliest step (on CUDA the pump may decode two steps behind); with health
            # findings only: the step before the exchange's marker (host step k decodes step k - 1 at the least)
            step=min((rep.step for rep in reports.values()), default=exchange.step - 1),
            reported_at=self._calls - 1,
            reports=reports,
            affected_request_ids=affected(violations),
            health=found.health,
        )

    def _act(self, verdict: RankVerdict | None) -> RankVerdict | None:
        if verdict is None:
            return None
        if self.mode is Mode.RAISE:
            raise RankedViolation(verdict) if verdict.reports else RankedHealthError(verdict)
        if self._limiter.allow():
            note = self._limiter.suppressed_note("verdict(s)")
            log = logger.warning if verdict.reports else logger.error
            log(verdict.block() + (f"\n  {note}" if note else ""))
        if self.mode is Mode.FAIL_REQUEST and self.on_fail_request is not None and verdict.reports:
            self.on_fail_request(list(verdict.affected_request_ids), verdict)
        return verdict


def _check_modes(manager: CanaryManager, mode: Mode, on_fail_request: object) -> None:
    """The wrapped manager only logs (this wrapper acts, once every rank agrees); the mode's callback is there."""
    if not isinstance(manager, CanaryManager):
        raise TypeError(f"manager must be a kvcanary CanaryManager, got {type(manager).__name__}")
    if not isinstance(mode, Mode):
        raise TypeError(f"mode must be a kvcanary.Mode, got {mode!r}")
    inner = manager.config.mode
    if (mode is Mode.OFF) != (inner is Mode.OFF) or inner not in (Mode.OFF, Mode.LOG):
        raise ValueError(
            f"the wrapped manager must run in mode 'log' (or 'off' with mode off) so it never acts alone; "
            f"got manager mode {inner.value!r} with mode {mode.value!r}"
        )
    if mode is Mode.FAIL_REQUEST and on_fail_request is None:
        raise ValueError("mode fail-request needs an on_fail_request callback")
    if on_fail_request is not None and not callable(on_fail_request):
        raise TypeError("on_fail_request must be callable")


def _check_exchange(process_group: object, timeout_s: float, lag: int, exchange_every: int) -> None:
    """The exchange's settings, and a process group this rank belongs to in an initialized torch.distributed."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    if not isinstance(lag, int) or lag < 1:
        raise ValueError(f"lag must be a positive int (exchanges in flight), got {lag!r}")
    if not isinstance(exchange_every, int) or exchange_every < 1:
        raise ValueError(f"exchange_every must be a positive int (host steps per exchange), got {exchange_every!r}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: pass the engine's own process group")
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"process_group must be the engine's torch.distributed ProcessGroup (e.g. its TP group), "
            f"got {type(process_group).__name__}"
        )
    if dist.get_rank(process_group) < 0:
        raise ValueError("this process is not a member of process_group")
