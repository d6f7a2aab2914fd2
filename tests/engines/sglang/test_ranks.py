"""Several sglang ranks, one verdict: sglang's own scheduler at tensor parallel 2 in two processes, the canary
installed as a server installs it (tests/engines/sglang/ranks_worker.py).

sglang builds its world and TP group itself (gloo on the CPU) and runs its Llama tensor parallel; the adapter
ranks each runner's manager on sglang's TP group.  A fault aliases one request's first KV slot in one rank's
own ``req_to_token`` at a decode step: every rank reports it at the same step (naming the faulty rank),
fail-request fails it on every rank, raise stops every rank at the same forward; a clean run is silent; a
rank killed inside its host step stops the other within the peer timeout instead of hanging it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from ranks_worker import PEER_TIMEOUT_S

from ranked_drive import spawn_world

WORKER = Path(__file__).resolve().parent / "ranks_worker.py"
SCENARIOS = "clean,log,fail,raise,kill"  # kill last: it ends the last rank
LIMIT_S = 400.0  # two sglang schedulers: about 40 s on 2 idle cores


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    from kvcanary.adapters.sglang.selftest.tiny_model import build_tiny_llama

    model = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    results = spawn_world(WORKER, 2, [str(model), SCENARIOS], tmp_path_factory.mktemp("ranks"), LIMIT_S)
    for r, res in results.items():
        assert "missing" not in res, f"rank {r} wrote no result; output:\n{res['missing']}"
    return results


def first_report(res: dict[str, Any]) -> dict[str, Any]:
    assert res["reports"], res
    return res["reports"][0]


def test_the_adapter_uses_sglangs_own_tp_group(world: dict[int, dict[str, Any]]) -> None:
    for res in world.values():
        assert res["group"] == {"name": "tp", "is_tp_cpu_group": True, "is_default_world": False}
        assert res["clean"]["kind"] == "RankedManager"


def test_a_clean_tensor_parallel_run_is_silent_on_every_rank(world: dict[int, dict[str, Any]]) -> None:
    for res in world.values():
        clean = res["clean"]
        assert "error" not in clean and clean["reports"] == [] and clean["warnings"] == [], clean
        assert clean["stats"]["violations"] == 0 and clean["stats"]["verified_slots"] > 0


def test_a_fault_on_one_rank_is_reported_by_every_rank_at_the_same_step(world: dict[int, dict[str, Any]]) -> None:
    assert world[1]["log"]["faults"] and not world[0]["log"]["faults"]  # only rank 1's table was edited
    assert world[0]["log"]["stats"]["violations"] == 0 < world[1]["log"]["stats"]["violations"]
    victim = world[1]["log"]["faults"][0].removeprefix("fault_")
    for res in world.values():
        first = first_report(res["log"])
        assert first["ids"] == [victim] and all(line.endswith(" rank=1") for line in first["lines"]), first
    assert len({json.dumps(res["log"]["reports"]) for res in world.values()}) == 1


def test_fail_request_fails_the_request_on_every_rank(world: dict[int, dict[str, Any]]) -> None:
    victim = world[1]["fail"]["faults"][0].removeprefix("fault_")
    for res in world.values():
        assert res["fail"]["failed"] and set(res["fail"]["failed"]) == {victim}, res["fail"]
    assert world[0]["fail"]["failed"] == world[1]["fail"]["failed"]


def test_raise_stops_every_rank_at_the_same_forward(world: dict[int, dict[str, Any]]) -> None:
    assert world[0]["raise"]["faults"] and not world[1]["raise"]["faults"]  # the fault on rank 0 this time
    raised = [(res["raise"].get("error"), res["raise"].get("at_forward")) for res in world.values()]
    assert raised[0][0] == "RankedViolation" and raised[0] == raised[1], raised


def test_a_killed_rank_stops_the_other_within_the_timeout(world: dict[int, dict[str, Any]]) -> None:
    assert "kill" not in world[1]  # it exited inside its host step
    lost = world[0]["kill"]
    # the first to notice may be the canary's exchange (CanaryPeerError) or sglang's own next collective;
    # either way within the peer timeout of the last host step (plus one forward on a loaded host)
    assert lost.get("error") is not None and lost["error_after_s"] < PEER_TIMEOUT_S + 10.0, lost
    if lost["error"] == "CanaryPeerError":
        assert "dead or stuck" in lost["message"]
