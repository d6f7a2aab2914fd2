"""What an adapter's manager becomes when the engine runs several ranks (tensor or pipeline parallel).

An adapter builds its manager through :func:`build_manager`, handing it the engine's own process
group (:func:`engine_group` picks it from the engine's TP, PP and world group coordinators; the
canary never creates a group of its own).  With one rank it is a plain :class:`CanaryManager`; with
several, a :class:`RankedManager`: the same calls, but ``host_step`` and ``flush`` return the ranks'
common verdict (:class:`~kvcanary.runtime.distributed.DistributedCanary`) as one report, identical on
every rank, and the mode acts on every rank at the same call.

The exchange runs on the group's CPU (gloo) side when the engine has one: the findings are host data
once the manager has decoded them, so the exchange never touches the GPU stream, a CUDA graph, or the
order of the engine's own device collectives.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch.distributed as dist

from kvcanary.config import CanaryConfig, Mode
from kvcanary.layout import CanaryGroup
from kvcanary.runtime.distributed import CanaryPeerError, DistributedCanary
from kvcanary.runtime.manager import CanaryManager
from kvcanary.runtime.report import FailRequestCallback, StepReport
from kvcanary.runtime.verdict import RankVerdict, merge_reports, verdict_report
from kvcanary.workspace import Capacities

DEFAULT_PEER_TIMEOUT_S = 60.0
PEER_TIMEOUT_ENV = "KVCANARY_PEER_TIMEOUT_S"  # how long a rank waits for its peers' verdict before it stops


class GroupCoordinator(Protocol):
    """The part of an engine's group coordinator (sglang's and vLLM's ``GroupCoordinator``) used here."""

    world_size: int
    cpu_group: Any
    device_group: Any


@dataclasses.dataclass(frozen=True)
class EngineGroup:
    """The engine's group that spans one model replica's ranks, as the canary uses it."""

    process_group: dist.ProcessGroup
    name: str  # which engine group: "tp", "pp" or "world"
    ranks: int
    lag: int  # exchanges in flight: 1 for tensor parallelism, the number of stages for pipeline parallelism


def engine_group(tp: GroupCoordinator, pp: GroupCoordinator, world: GroupCoordinator) -> EngineGroup | None:
    """The engine's own group over one replica's tensor x pipeline ranks; None with a single rank.

    The TP group when there is no pipeline, the PP group when there is no tensor parallelism, the world
    group when it holds exactly the TP x PP ranks; otherwise (TP and PP with data parallel ranks in the
    same world) no single engine group spans the replica, and this raises rather than create one."""
    tp_n, pp_n = int(tp.world_size), int(pp.world_size)
    if tp_n * pp_n == 1:
        return None
    if pp_n == 1:
        coordinator, name = tp, "tp"
    elif tp_n == 1:
        coordinator, name = pp, "pp"
    elif int(world.world_size) == tp_n * pp_n:
        coordinator, name = world, "world"
    else:
        raise ValueError(
            f"kvcanary: tensor parallel {tp_n} x pipeline parallel {pp_n} inside a world of {world.world_size} "
            "ranks: no engine group spans exactly one replica, and the canary does not create its own"
        )
    group = coordinator.cpu_group if coordinator.cpu_group is not None else coordinator.device_group
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"kvcanary: the engine's {name} group has no torch.distributed ProcessGroup")
    return EngineGroup(group, name, tp_n * pp_n, lag=pp_n)


def peer_timeout_s(environ: Mapping[str, str] = os.environ) -> float:
    """The peer timeout from ``KVCANARY_PEER_TIMEOUT_S`` (seconds), or the default."""
    raw = environ.get(PEER_TIMEOUT_ENV, "")
    if not raw:
        return DEFAULT_PEER_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{PEER_TIMEOUT_ENV} must be a positive number of seconds, got {raw!r}")
    return value


def build_manager(
    groups: Sequence[CanaryGroup],
    caps: Capacities | Mapping[str, Capacities],
    config: CanaryConfig,
    *,
    group: EngineGroup | None,
    on_fail_request: FailRequestCallback | None = None,
    timeout_s: float | None = None,
    **manager_options: Any,
) -> CanaryManager | RankedManager:
    """This rank's manager: a plain one without ``group`` (or in mode off), else ranked on ``group``.

    An adapter passes its engine's group (``<engine>.ranks.<engine>_group()``); ``timeout_s`` None reads
    :data:`PEER_TIMEOUT_ENV` (:func:`peer_timeout_s`).  Ranked, the mode and ``on_fail_request`` act on the
    common verdict, so the inner manager logs; ``manager_options`` (``device``, ``backend``...) go to
    :class:`CanaryManager` as they are."""
    if group is None or config.mode is Mode.OFF:
        return CanaryManager(groups, caps, config, on_fail_request=on_fail_request, **manager_options)
    inner = CanaryManager(groups, caps, dataclasses.replace(config, mode=Mode.LOG), **manager_options)
    timeout = peer_timeout_s() if timeout_s is None else timeout_s
    return RankedManager(inner, group, config.mode, on_fail_request, timeout_s=timeout)


class RankedManager:
    """A :class:`CanaryManager` in ``log`` mode wrapped so that every rank reports and acts alike.

    ``host_step`` and ``flush`` return the common verdict as one :class:`StepReport` (every finding
    rank's rows in rank order, each row naming its rank) or None, identically on every rank;
    ``raise`` raises :class:`~kvcanary.runtime.verdict.RankedViolation` (a ``CanaryViolation``) on every
    rank, ``fail-request`` calls ``on_fail_request`` on every rank with the same ids.  A peer that does
    not answer within ``timeout_s`` raises :class:`CanaryPeerError` on the waiting rank, and again at
    every later call: once a peer is lost, the ranks can no longer agree.  Every other attribute
    (``before_forward``, ``after_forward``, ``canaries``, digests, ``stats``...) is the inner manager's.
    """

    def __init__(
        self,
        manager: CanaryManager,
        group: EngineGroup,
        mode: Mode,
        on_fail_request: FailRequestCallback | None = None,
        *,
        timeout_s: float = DEFAULT_PEER_TIMEOUT_S,
    ) -> None:
        self.group = group
        self.last_verdict: RankVerdict | None = None
        self._on_fail_request = on_fail_request
        self._lost: CanaryPeerError | None = None
        callback = self._fail if on_fail_request is not None else None
        self.ranked = DistributedCanary(
            manager, group.process_group, mode, callback, timeout_s=timeout_s, lag=group.lag
        )

    def __getattr__(self, name: str) -> Any:
        if name == "ranked":  # not set: __init__ failed
            raise AttributeError(name)
        return getattr(self.ranked.manager, name)

    @property
    def rank(self) -> int:
        return self.ranked.rank

    def host_step(self, request_ids: Sequence[object] | None = None) -> StepReport | None:
        """This rank's step, then the lagged exchange; the common verdict's report (same on every rank)."""
        return self._report(self._call(self.ranked.host_step, request_ids))

    def flush(self) -> StepReport | None:
        """End of a run (or of a synchronous step): every exchange in flight settled, their reports as one."""
        reports = [r for v in self._call(self.ranked.flush) if (r := self._report(v)) is not None]
        return merge_reports(reports) if reports else None

    def _call(self, fn: Any, *args: Any) -> Any:
        if self._lost is not None:
            raise CanaryPeerError(f"kvcanary: the ranks' verdict exchange was lost earlier: {self._lost}")
        try:
            return fn(*args)
        except CanaryPeerError as exc:
            self._lost = exc
            raise

    def _report(self, verdict: RankVerdict | None) -> StepReport | None:
        if verdict is None:
            return None
        self.last_verdict = verdict
        return verdict_report(verdict)

    def _fail(self, request_ids: list[object], verdict: RankVerdict) -> None:
        report = verdict_report(verdict)
        assert self._on_fail_request is not None and report is not None  # fail-request acts only on violations
        self._on_fail_request(request_ids, report)
