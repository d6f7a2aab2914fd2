"""DistributedCanary in one process (a one-rank gloo world): misuse errors, the verdict, portable reports."""

from __future__ import annotations

import dataclasses
import logging
import pickle
import re
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from kvcanary import CanaryConfig, CanaryGroup, Mode
from kvcanary.runtime import CanaryManager, StepReport
from kvcanary.runtime.distributed import DistributedCanary, RankedViolation, RankVerdict
from kvcanary.runtime.exchange import VerdictExchange
from kvcanary.runtime.verdict import portable_bytes
from runtime_helpers import CAPS, NUM_SLOTS, Workload, alias_first_slot, gloo_world

GROUPS = [CanaryGroup(num_slots=NUM_SLOTS, name="full")]


def test_needs_an_initialized_process_group() -> None:
    assert not dist.is_initialized()
    mgr = CanaryManager(GROUPS, CAPS, CanaryConfig(mode=Mode.LOG))
    with pytest.raises(RuntimeError, match="not initialized"):
        DistributedCanary(mgr, None, Mode.LOG)  # type: ignore[arg-type]


@pytest.fixture
def world() -> Iterator[dist.ProcessGroup]:
    with gloo_world() as group:
        yield group


def make(world: dist.ProcessGroup, mode: Mode, **kw: object) -> DistributedCanary:
    return DistributedCanary.create(GROUPS, CAPS, CanaryConfig(mode=mode), world, **kw)  # type: ignore[arg-type]


def test_misuse_is_refused_before_anything_runs(world: dist.ProcessGroup) -> None:
    acting = CanaryManager(GROUPS, CAPS, CanaryConfig(mode=Mode.RAISE))
    with pytest.raises(ValueError, match="must run in mode 'log'"):
        DistributedCanary(acting, world, Mode.RAISE)
    logging_mgr = CanaryManager(GROUPS, CAPS, CanaryConfig(mode=Mode.LOG))
    with pytest.raises(ValueError, match="needs an on_fail_request callback"):
        DistributedCanary(logging_mgr, world, Mode.FAIL_REQUEST)
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        DistributedCanary(logging_mgr, world, Mode.LOG, timeout_s=0)
    with pytest.raises(ValueError, match="lag must be a positive int"):
        DistributedCanary(logging_mgr, world, Mode.LOG, lag=0)
    with pytest.raises(TypeError, match="process_group must be"):
        DistributedCanary(logging_mgr, None, Mode.LOG)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="CanaryManager"):
        DistributedCanary(object(), world, Mode.LOG)  # type: ignore[arg-type]


def steps(canary: DistributedCanary, n: int, fault_at: int | None) -> list[RankVerdict | None]:
    wl = Workload()
    out = []
    for k in range(n):
        if k == fault_at:
            alias_first_slot(wl, victim=2, owner=1)
        canary.before_forward({"full": wl.batch([(1, 4 if k == 0 else 1), (2, 4 if k == 0 else 1)])})
        canary.after_forward()
        out.append(canary.host_step(["a", "b"]))
    return out


def test_one_rank_world_reports_two_steps_late_and_flushes(world: dist.ProcessGroup) -> None:
    canary = make(world, Mode.LOG)
    seen = steps(canary, 4, fault_at=1)
    assert seen[:3] == [None, None, None]
    verdict = seen[3]
    assert verdict is not None and verdict.step == 1 and verdict.reported_at == 3 and verdict.ranks == (0,)
    assert verdict.affected_request_ids == ("b",) and "found on rank(s) [0]" in verdict.block()
    assert [v.step for v in canary.flush()] == [2, 3]
    assert canary.flush() == []


def test_a_deeper_lag_acts_lag_steps_later_and_flush_drains_everything(world: dist.ProcessGroup) -> None:
    canary = make(world, Mode.LOG, lag=3)
    seen = steps(canary, 6, fault_at=1)
    assert seen[:5] == [None] * 5 and canary.in_flight == 3
    verdict = seen[5]
    assert verdict is not None and verdict.step == 1 and verdict.reported_at == 5
    assert [v.step for v in canary.flush()] == [2, 3, 4, 5] and canary.in_flight == 0


def test_raise_mode_raises_a_ranked_violation(world: dist.ProcessGroup) -> None:
    canary = make(world, Mode.RAISE)
    with pytest.raises(RankedViolation, match=r"found on rank\(s\) \[0\]") as info:
        steps(canary, 4, fault_at=1)
    assert info.value.verdict.step == 1 and info.value.report.step == 1


def test_off_mode_exchanges_nothing(world: dist.ProcessGroup) -> None:
    canary = make(world, Mode.OFF)
    assert steps(canary, 3, fault_at=1) == [None] * 3 and canary.flush() == []
    assert canary.in_flight == 0


def test_unpicklable_request_ids_travel_as_their_repr(world: dist.ProcessGroup) -> None:
    canary = make(world, Mode.LOG)
    steps(canary, 3, fault_at=1)
    report = canary.manager.flush()
    assert report is not None and report.violations
    unpicklable = lambda: None  # noqa: E731  (a lambda does not pickle)
    violations = tuple(dataclasses.replace(v, request_id=unpicklable) for v in report.violations)
    report = dataclasses.replace(report, violations=violations, affected_request_ids=(unpicklable,))
    back = pickle.loads(portable_bytes(report))
    assert isinstance(back, StepReport) and back.total == report.total
    assert back.affected_request_ids == (repr(unpicklable),)
    assert all(v.request_id == repr(unpicklable) for v in back.violations)


def test_only_violations_take_the_slow_path(world: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch) -> None:
    # Clean steps and failed health checks are settled by the per-step row alone: no report is pickled or sent.
    gathered: list[str] = []
    original = VerdictExchange.gather_bytes

    def counting(self: VerdictExchange, payload: bytes, what: str) -> list[bytes]:
        gathered.append(what)
        return original(self, payload, what)

    monkeypatch.setattr(VerdictExchange, "gather_bytes", counting)
    canary = make(world, Mode.LOG)
    wl = Workload()
    verdicts = []
    for k in range(8):
        if k == 3:  # a replay without the canary's work: the phase check fails once
            canary.manager._graph_captured = True
        else:
            if k == 5:
                alias_first_slot(wl, victim=2, owner=1)
            canary.before_forward({"full": wl.batch([(1, 4 if k == 0 else 1), (2, 4 if k == 0 else 1)])})
            canary.after_forward()
        verdicts.append(canary.host_step(["a", "b"]))
        if k == 5:
            assert gathered == [], "a clean step or a failed check took the slow path"
    health, violation = verdicts[5], verdicts[7]
    assert verdicts[:5] == [None] * 5 and verdicts[6] is None
    assert health is not None and health.health == {0: {"phase": 1}} and health.ranks == () and health.step == 3
    assert violation is not None and violation.ranks == (0,) and violation.step == 5 and violation.health == {}
    assert gathered == ["the report exchange of rank(s) [0]"]


def test_the_verdict_log_is_rate_limited_and_counts_what_it_held_back(
    world: dist.ProcessGroup, caplog: pytest.LogCaptureFixture
) -> None:
    now = [0.0]
    canary = DistributedCanary(
        CanaryManager(GROUPS, CAPS, CanaryConfig(mode=Mode.LOG, log_rate_limit_per_s=1.0)),
        world,
        Mode.LOG,
        clock=lambda: now[0],
    )
    wl = Workload()
    verdicts = 0
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        for k in range(12):
            if k == 1:
                alias_first_slot(wl, victim=2, owner=1)
            now[0] = 0.25 * k
            canary.before_forward({"full": wl.batch([(1, 4 if k == 0 else 1), (2, 4 if k == 0 else 1)])})
            canary.after_forward()
            verdicts += canary.host_step(["a", "b"]) is not None
    blocks = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kvcanary: violation(s) at step")]
    held = sum(int(n) for b in blocks for n in re.findall(r"\((\d+) earlier verdict\(s\) suppressed", b))
    assert verdicts == 9 and len(blocks) == 3  # verdicts from call 3 on; logged at 0.75, 1.75 and 2.75 s
    assert held == 3 + 3  # the ones between the logged ones, each counted in the next logged block
    assert canary._limiter.suppressed == verdicts - len(blocks) - held


def test_exchange_every_three_steps_divides_the_collectives_and_acts_on_whole_windows(
    world: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    markers: list[int] = []
    original = VerdictExchange.start

    def counting(self: VerdictExchange, step: int, rows: int, health: tuple[int, ...] = ()) -> None:
        markers.append(step)
        original(self, step, rows, health)

    monkeypatch.setattr(VerdictExchange, "start", counting)
    clean = make(world, Mode.LOG, exchange_every=3)
    assert steps(clean, 9, fault_at=None) == [None] * 9 and clean.flush() == []
    assert markers == [2, 5, 8, 9]  # one exchange per window of three calls, and flush's
    markers.clear()
    canary = make(world, Mode.LOG, exchange_every=3)
    seen = steps(canary, 9, fault_at=1)
    # step 1 is decoded at call 2, the last of the first window; that exchange is finished at call 5
    assert [k for k, v in enumerate(seen) if v is not None] == [5, 8]
    first, second = seen[5], seen[8]
    assert first is not None and first.step == 1 and first.reported_at == 5 and first.affected_request_ids == ("b",)
    # the second window holds steps 2, 3 and 4 (the fault persists): one verdict, the rank's reports merged
    assert second is not None and second.step == 2 and second.reports[0].total == 3
    assert [v.step for v in canary.flush()] == [5, 8]
    with pytest.raises(ValueError, match="exchange_every must be a positive int"):
        make(world, Mode.LOG, exchange_every=0)
