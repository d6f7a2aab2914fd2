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
from kvcanary.runtime.report import CanaryHealthError, CanaryViolation, StepReport, affected
from kvcanary.workspace import Capacities

logger = logging.getLogger("kvcanary")

__all__ = ["CanaryPeerError", "DistributedCanary", "RankVerdict", "RankedHealthError", "RankedViolation"]


@dataclasses.dataclass(frozen=True)
class RankVerdict:
    """What the ranks found at one host step, identical on every rank.

    ``reports`` maps the group rank of each rank that found violations to its own report; the
    affected request ids are their union, in rank order.  ``health`` maps each rank whose health
    checks failed to its failed checks (check name -> count).
    """

    step: int  # the host step the findings are about
    reported_at: int  # the host step call (or flush) that acted on them, on every rank
    reports: Mapping[int, StepReport]
    affected_request_ids: tuple[object, ...]
    health: Mapping[int, Mapping[str, int]] = dataclasses.field(default_factory=dict)

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks that found violations."""
        return tuple(sorted(self.reports))

    @property
    def health_ranks(self) -> tuple[int, ...]:
        """The ranks whose health checks failed."""
        return tuple(sorted(self.health))

    def block(self) -> str:
        lines = []
        if self.reports:
            ids = ", ".join(repr(r) for r in self.affected_request_ids) or "unknown"
            lines.append(
                f"kvcanary: violation(s) at step {self.step} found on rank(s) {list(self.ranks)} "
                f"(acted on at step {self.reported_at} on every rank); requests: {ids}"
            )
            lines += [
                f"  rank {r}: {self.reports[r].total} row(s), counts {self.reports[r].counts}" for r in self.ranks
            ]
        if self.health:
            lines.append(self.health_line())
        return "\n".join(lines)

    def health_line(self) -> str:
        failed = "; ".join(
            f"rank {r}: " + ", ".join(f"{check} x{n}" for check, n in self.health[r].items()) for r in self.health_ranks
        )
        return (
            f"kvcanary: health check(s) failed at step {self.step} on rank(s) {list(self.health_ranks)} "
            f"(acted on at step {self.reported_at} on every rank): {failed}"
        )


class RankedViolation(CanaryViolation):
    """Raised on every rank in ``raise`` mode; ``report`` is the lowest finding rank's, ``verdict`` all of them."""

    def __init__(self, verdict: RankVerdict) -> None:
        super().__init__(verdict.reports[verdict.ranks[0]])
        self.args = (verdict.block(),)
        self.verdict = verdict


class RankedHealthError(CanaryHealthError):
    """Raised on every rank in ``raise`` mode when a rank's health check failed (and no rank found violations)."""

    def __init__(self, verdict: RankVerdict) -> None:
        super().__init__(verdict.health_line())
        self.verdict = verdict


DistributedFailRequestCallback = Callable[[list[object], RankVerdict], None]


class DistributedCanary:
    """One rank's canary that reports, and acts, in agreement with every rank of ``process_group``.

    ``manager`` is this rank's :class:`CanaryManager`, configured in ``log`` mode (or ``off``); the
    mode to act by is ``mode``.  ``timeout_s`` bounds every wait on a peer.
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
        device: torch.device | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
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
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if not isinstance(lag, int) or lag < 1:
            raise ValueError(f"lag must be a positive int (exchanges in flight), got {lag!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: pass the engine's own process group")
        if not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                f"process_group must be the engine's torch.distributed ProcessGroup (e.g. its TP group), "
                f"got {type(process_group).__name__}"
            )
        if dist.get_rank(process_group) < 0:
            raise ValueError("this process is not a member of process_group")
        self.manager = manager
        self.mode = mode
        self.on_fail_request = on_fail_request
        self._enabled = mode is not Mode.OFF
        self._calls = 0  # host_step/flush calls so far: the exchange's step marker
        self._health_seen = self._health_counts()
        self.lag = lag
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
    ) -> DistributedCanary:
        """This rank's manager (built in log mode) wrapped to act by ``config.mode`` with every rank."""
        inner = config if config.mode is Mode.OFF else dataclasses.replace(config, mode=Mode.LOG)
        manager = CanaryManager(groups, caps, inner, device, backend)
        return cls(manager, process_group, config.mode, on_fail_request, timeout_s=timeout_s, lag=lag)

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
        local = self.manager.host_step(request_ids)
        verdict = self._finish() if len(self._in_flight) == self.lag else None
        self._start(local, self._health_delta())
        return self._act(verdict)

    def flush(self) -> list[RankVerdict]:
        """End of a run: act on the exchanges in flight, then on the manager's last step (synchronously)."""
        if not self._enabled:
            return []
        local = self.manager.flush()
        health = self._health_delta()
        out = []
        while self._in_flight:
            out.append(self._act(self._finish()))
        self._start(local, health)
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

    def _start(self, local: StepReport | None, health: tuple[int, ...] = ()) -> None:
        rows = 0 if local is None else max(local.total, 1)
        # Free by construction: the ones in flight started at the previous lag - 1 calls.
        exchange = self._exchanges[self._calls % self.lag]
        exchange.start(self._calls, rows, health)
        self._in_flight.append((exchange, local))
        self._calls += 1

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
            payloads = exchange.gather_bytes(_portable_bytes(mine), f"the report exchange of rank(s) {ranks}")
            # Peers' reports come pickled from the same job; this rank keeps its own (unpickled ids intact).
            reports = {r: mine if r == self.rank and mine is not None else pickle.loads(payloads[r]) for r in ranks}
        violations = [v for r in sorted(reports) for v in reports[r].violations]
        return RankVerdict(
            # the manager's host step k (or flush) decodes step k - 1, and exchanges under marker k
            step=min((rep.step for rep in reports.values()), default=exchange.step - 1),
            reported_at=self._calls,
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


def _portable_bytes(report: StepReport | None) -> bytes:
    """The report pickled for the peers; request ids that do not pickle travel as their ``repr``."""
    try:
        return pickle.dumps(report)
    except (pickle.PicklingError, TypeError, AttributeError):
        assert report is not None
        violations = tuple(
            dataclasses.replace(v, request_id=None if v.request_id is None else repr(v.request_id))
            for v in report.violations
        )
        portable = dataclasses.replace(report, violations=violations, affected_request_ids=affected(violations))
        return pickle.dumps(portable)
