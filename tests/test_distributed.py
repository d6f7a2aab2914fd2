"""DistributedCanary on CPU with gloo: 2 and 4 real processes, a fault on one rank only.

Each world runs as subprocesses of tests/distributed_ranks.py (localhost, a free port, time-limited);
the scenarios of one world share its processes so the tests stay fast on a small machine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from distributed_ranks import FAULT_AT, PEER_TIMEOUT_S, STEPS
from ranked_drive import spawn_world

WORKER = Path(__file__).resolve().parent / "distributed_ranks.py"
SCENARIOS = "clean,log,fail,raise,lag2,health-fail,health-raise,every3,digest"
RUN_LIMIT_S = 240.0  # a whole world of scenarios; about 20 s on 2 idle cores, far more on a loaded host


def run_world(world: int, scenarios: str, out: Path) -> dict[int, dict[str, Any]]:
    return spawn_world(WORKER, world, [scenarios], out, RUN_LIMIT_S)


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    out = tmp_path_factory.mktemp(f"world{request.param}")
    results = run_world(request.param, SCENARIOS, out)
    for r, res in results.items():
        assert "missing" not in res, f"rank {r} wrote no result; its output:\n{res['missing']}"
    return results


def test_clean_run_is_silent_on_every_rank(world: dict[int, dict[str, Any]]) -> None:
    for res in world.values():
        clean = res["clean"]
        assert clean["seen"] == [None] * STEPS and clean["flushed"] == []
        assert clean["warnings"] == [] and clean["callbacks"] == []


def test_fault_on_one_rank_is_reported_by_every_rank_at_the_same_step(world: dict[int, dict[str, Any]]) -> None:
    faulty = len(world) - 1
    first_hits = set()
    for res in world.values():
        seen = res["log"]["seen"]
        hits = [k for k, v in enumerate(seen) if v is not None]
        assert hits, "a rank did not report the fault"
        first_hits.add(hits[0])
        v = seen[hits[0]]
        assert v["step"] == FAULT_AT and v["ranks"] == [faulty] and v["ids"] == ["req-b"]
        assert any(f"found on rank(s) [{faulty}]" in m for m in res["log"]["warnings"])
    # decoded at FAULT_AT + 1 by the faulty rank's manager, agreed on at FAULT_AT + 2 by everyone
    assert first_hits == {FAULT_AT + 2}
    assert len({json.dumps(res["log"]["seen"]) for res in world.values()}) == 1


def test_a_lag_of_two_agrees_one_step_later_on_every_rank(world: dict[int, dict[str, Any]]) -> None:
    faulty = len(world) - 1
    for res in world.values():
        seen = res["lag2"]["seen"]
        hits = [k for k, v in enumerate(seen) if v is not None]
        assert hits and hits[0] == FAULT_AT + 3, seen
        assert seen[hits[0]]["step"] == FAULT_AT and seen[hits[0]]["ranks"] == [faulty]
        # flush drains both exchanges in flight and the manager's last step: steps STEPS - 3 .. STEPS - 1
        assert [v["step"] for v in res["lag2"]["flushed"]] == [STEPS - 3, STEPS - 2, STEPS - 1]
    assert len({json.dumps([res["lag2"]["seen"], res["lag2"]["flushed"]]) for res in world.values()}) == 1


def test_fail_request_fails_the_request_on_every_rank_once_per_step(world: dict[int, dict[str, Any]]) -> None:
    expected = None
    for res in world.values():
        calls = res["fail"]["callbacks"]
        # the fault persists: one call per reported step, each naming the victim once
        assert calls and all(c == ["req-b"] for c in calls)
        expected = len(calls) if expected is None else expected
        assert len(calls) == expected


def test_raise_mode_raises_on_every_rank_at_the_same_step(world: dict[int, dict[str, Any]]) -> None:
    for res in world.values():
        raised = res["raise"]
        assert raised.get("raised_at") == FAULT_AT + 2, raised
        assert raised["ranks"] == [0] and raised["step"] == FAULT_AT


def test_exchanging_every_three_steps_agrees_on_the_window_on_every_rank(world: dict[int, dict[str, Any]]) -> None:
    faulty = len(world) - 1
    for res in world.values():
        # the fault's first decode (call FAULT_AT + 1) falls in the window of calls 3..5: exchanged at call 5,
        # finished by flush, with the window after it (the manager's last step)
        assert res["every3"]["seen"] == [None] * STEPS
        flushed = res["every3"]["flushed"]
        assert [v["step"] for v in flushed] == [FAULT_AT, STEPS - 1]
        assert all(v["ranks"] == [faulty] and v["ids"] == ["req-b"] for v in flushed)
    assert len({json.dumps(res["every3"]["flushed"]) for res in world.values()}) == 1


def test_a_health_failure_on_one_rank_is_reported_by_every_rank_at_the_same_step(
    world: dict[int, dict[str, Any]],
) -> None:
    faulty = str(len(world) - 1)  # JSON keys
    for res in world.values():
        seen = res["health-fail"]["seen"]
        hits = [k for k, v in enumerate(seen) if v is not None]
        # decoded at FAULT_AT + 1 by the unhealthy rank's manager, agreed on at FAULT_AT + 2 by everyone
        assert hits == [FAULT_AT + 2], seen
        v = seen[hits[0]]
        assert v["health"] == {faulty: {"phase": 1}} and v["ranks"] == [] and v["step"] == FAULT_AT
        assert res["health-fail"]["callbacks"] == []  # a failed check names no request: fail-request only logs
        assert any(
            f"health check(s) failed at step {FAULT_AT} on rank(s) [{faulty}]" in m
            for m in res["health-fail"]["warnings"]
        )
    assert len({json.dumps(res["health-fail"]["seen"]) for res in world.values()}) == 1


def test_raise_mode_raises_a_health_failure_on_every_rank_at_the_same_step(world: dict[int, dict[str, Any]]) -> None:
    faulty = str(len(world) - 1)
    for res in world.values():
        raised = res["health-raise"]
        assert raised.get("health_raised_at") == FAULT_AT + 2, raised
        assert raised["health"] == {faulty: {"phase": 1}} and raised["step"] == FAULT_AT
        assert f"rank {faulty}: phase x1" in raised["message"]


@pytest.mark.parametrize("how", ["kill", "stall"])
def test_a_dead_or_stuck_peer_gives_a_clear_error_within_the_timeout(how: str, tmp_path: Path) -> None:
    results = run_world(2, how, tmp_path)
    assert "missing" in results[1]  # the lost rank never wrote
    lost = results[0][how]
    # The peer vanished before its host step FAULT_AT: a stuck one had finished its last exchange, so
    # rank 0 times out on the next; a killed one may die with its last exchange still in flight.
    at = (FAULT_AT + 1,) if how == "stall" else (FAULT_AT, FAULT_AT + 1)
    assert lost.get("peer_error_at") in at, lost
    assert "dead or stuck" in lost["message"] and f"within {PEER_TIMEOUT_S:g} s" in lost["message"]
    assert f"host step {lost['peer_error_at'] - 1} " in lost["message"] and "rank 0 of 2" in lost["message"]
    assert lost["waited_s"] < PEER_TIMEOUT_S + 2.0


def test_an_adapters_manager_names_the_rank_whose_shard_digest_mismatched(world: dict[int, dict[str, Any]]) -> None:
    """ranked.build_manager (what the sglang and vLLM adapters call) with the KV digest on each rank's shard:
    one byte flipped in the last rank's shard is reported by every rank, at the same step, naming that rank."""
    faulty = len(world) - 1
    for res in world.values():
        digest = res["digest"]
        assert digest["kind"] == "RankedManager"
        hits = [k for k, v in enumerate(digest["seen"]) if v is not None]
        assert hits and hits[0] == FAULT_AT + 2, digest["seen"]
        first = digest["seen"][hits[0]]
        assert first["step"] == FAULT_AT and first["lines"]
        assert all("reasons=digest_mismatch" in line and line.endswith(f" rank={faulty}") for line in first["lines"])
        assert f"[full] on rank {faulty} request 'req-b'" in first["block"]
        assert any(f"rank {faulty}: " in m and "digest_mismatch" in m for m in res["digest"]["warnings"])
    assert len({json.dumps(res["digest"]["seen"]) for res in world.values()}) == 1
