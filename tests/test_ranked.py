"""runtime/ranked.py in one process (a one-rank gloo world): which engine group an adapter uses, the peer
timeout setting, and a RankedManager seen through the calls an adapter makes (same report on every rank;
the multi-rank behaviour is in tests/test_distributed.py and the engines' own tests)."""

from __future__ import annotations

import types
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from kvcanary import CanaryConfig, CanaryGroup, Mode
from kvcanary.runtime import CanaryManager, CanaryViolation, StepReport, ranked
from kvcanary.runtime.distributed import RankedViolation
from runtime_helpers import CAPS, NUM_SLOTS, Workload, alias_first_slot, gloo_world

GROUPS = [CanaryGroup(num_slots=NUM_SLOTS, name="full")]
IDS = ["req-a", "req-b"]


@pytest.fixture
def world() -> Iterator[dist.ProcessGroup]:
    with gloo_world() as group:
        yield group


def coordinator(size: int, cpu: object = None, device: object = None) -> types.SimpleNamespace:
    return types.SimpleNamespace(world_size=size, cpu_group=cpu, device_group=device)


def test_the_engine_group_spans_one_replica_and_prefers_the_gloo_side(world: dist.ProcessGroup) -> None:
    other = object()  # stands for the device (NCCL) group: never chosen while a CPU group exists
    one = coordinator(1, world, other)
    assert ranked.engine_group(one, one, one) is None
    tp = ranked.engine_group(coordinator(2, world, other), one, coordinator(2, world, other))
    assert tp is not None and (tp.name, tp.ranks, tp.lag, tp.process_group) == ("tp", 2, 1, world)
    pp = ranked.engine_group(one, coordinator(3, world, other), coordinator(3, world, other))
    assert pp is not None and (pp.name, pp.ranks, pp.lag) == ("pp", 3, 3)
    both = ranked.engine_group(coordinator(2, other), coordinator(2, other), coordinator(4, world))
    assert both is not None and (both.name, both.ranks, both.lag) == ("world", 4, 2)
    device_only = ranked.engine_group(coordinator(2, None, world), one, one)
    assert device_only is not None and device_only.process_group is world
    with pytest.raises(ValueError, match="no engine group spans exactly one replica"):
        ranked.engine_group(coordinator(2, world), coordinator(2, world), coordinator(8, world))
    with pytest.raises(TypeError, match=r"tp group has no torch\.distributed ProcessGroup"):
        ranked.engine_group(coordinator(2, None, None), one, one)


def test_the_peer_timeout_comes_from_the_environment() -> None:
    assert ranked.peer_timeout_s({}) == ranked.DEFAULT_PEER_TIMEOUT_S
    assert ranked.peer_timeout_s({ranked.PEER_TIMEOUT_ENV: "2.5"}) == 2.5
    for bad in ("0", "-1", "soon"):
        with pytest.raises(ValueError, match="KVCANARY_PEER_TIMEOUT_S must be a positive number"):
            ranked.peer_timeout_s({ranked.PEER_TIMEOUT_ENV: bad})


def drive(manager: CanaryManager | ranked.RankedManager, steps: int = 5, fault_at: int = 1) -> list[StepReport | None]:
    wl, out = Workload(), []
    for k in range(steps):
        if k == fault_at:
            alias_first_slot(wl, victim=2, owner=1)
        manager.before_forward({"full": wl.batch([(1, 4 if k == 0 else 1), (2, 4 if k == 0 else 1)])})
        manager.after_forward()
        out.append(manager.host_step(IDS))
    return out


def test_one_rank_gets_a_plain_manager_in_its_own_mode() -> None:
    manager = ranked.build_manager(GROUPS, CAPS, CanaryConfig(mode=Mode.RAISE), group=None)
    assert type(manager) is CanaryManager and manager.config.mode is Mode.RAISE
    with pytest.raises(CanaryViolation) as raised:
        drive(manager)
    assert not isinstance(raised.value, RankedViolation)


def test_a_ranked_manager_answers_the_adapters_calls_with_the_common_verdict(world: dist.ProcessGroup) -> None:
    group = ranked.EngineGroup(world, "tp", 1, lag=1)
    calls: list[tuple[list[object], StepReport]] = []
    config = CanaryConfig(mode=Mode.FAIL_REQUEST)
    manager = ranked.build_manager(GROUPS, CAPS, config, on_fail_request=lambda i, r: calls.append((i, r)), group=group)
    assert isinstance(manager, ranked.RankedManager)
    assert manager.config.mode is Mode.LOG and manager.canaries["full"] is not None  # the inner manager's
    reports = drive(manager)
    # decoded one step late by the manager, agreed on one exchange later: step 1's fault at call 3
    assert reports[:3] == [None, None, None] and all(r is not None for r in reports[3:])
    first = reports[3]
    assert first is not None and first.step == 1 and first.affected_request_ids == ("req-b",)
    assert all(v.rank == 0 and v.line(first.step).endswith(" rank=0") for v in first.violations)
    assert calls and calls[0][0] == ["req-b"] and calls[0][1] == first
    assert manager.last_verdict is not None and manager.last_verdict.ranks == (0,)
    flushed = manager.flush()
    # the exchange in flight (step 3) and the manager's last step (4), as one report from the first
    assert flushed is not None and (flushed.step, flushed.total, flushed.reported_at) == (3, 2, 5)


def test_a_ranked_manager_raises_a_ranked_violation_in_raise_mode(world: dist.ProcessGroup) -> None:
    group = ranked.EngineGroup(world, "tp", 1, lag=1)
    manager = ranked.build_manager(GROUPS, CAPS, CanaryConfig(mode=Mode.RAISE), group=group)
    with pytest.raises(RankedViolation) as raised:
        drive(manager)
    assert raised.value.verdict.step == 1 and raised.value.verdict.reported_at == 3


def test_mode_off_builds_a_plain_manager_even_with_several_ranks(world: dist.ProcessGroup) -> None:
    group = ranked.EngineGroup(world, "tp", 1, lag=1)
    manager = ranked.build_manager(GROUPS, CAPS, CanaryConfig(mode=Mode.OFF), group=group)
    assert type(manager) is CanaryManager and manager.canaries == {}
