"""The manager driven by the scripted paged-KV engine (two groups, padding rows, shared prefixes).

Request ids come from the engine's batch rows (None for padding); the report of a fault injected at
step k names the victim request at step k + 1 and nobody else, in fail-request mode.
"""

from __future__ import annotations

from kvcanary import CanaryConfig, Capacities, Mode
from kvcanary.runtime import CanaryManager, StepReport
from scripted_engine import EngineStep, ScriptedEngine, standard_workload

CAPS = Capacities(max_batch=8, max_tokens=32, verify_entries=128, max_context=24)


def run(engine: ScriptedEngine) -> tuple[list[StepReport | None], list[tuple[list[object], int]], CanaryManager]:
    failed: list[tuple[list[object], int]] = []
    mgr = CanaryManager(
        engine.canary_groups(),
        CAPS,
        CanaryConfig(mode=Mode.FAIL_REQUEST, health_every=5),
        on_fail_request=lambda ids, report: failed.append((ids, report.step)),
    )
    reports = []
    while not engine.done:
        step = engine.begin_step()
        mgr.before_forward({"full": step.full(True), "window": step.window(True)})
        mgr.after_forward()
        reports.append(mgr.host_step(step.rids))
        engine.end_step()
    reports.append(mgr.flush())
    return reports, failed, mgr


def test_clean_workload_fails_nobody() -> None:
    reports, failed, mgr = run(ScriptedEngine(standard_workload()))
    assert reports == [None] * len(reports) and failed == []
    s = mgr.stats()
    assert s["steps"] == 15 and s["violations"] == 0 and s["health_failures"] == 0 and s["verified_slots"] > 0


def test_fault_fails_only_the_victim_one_step_later() -> None:
    engine = ScriptedEngine(standard_workload())

    def alias(e: ScriptedEngine, step: EngineStep) -> None:
        # request 2's position-5 entry now points at request 1's slot for position 5
        e.req_to_token[e.request(2).row, 5] = e.slot_at(1, 5)

    engine.before_forward(6, alias)
    reports, failed, _ = run(engine)
    first = next(i for i, r in enumerate(reports) if r is not None)
    report = reports[first]
    assert first == 7 and report is not None and report.step == 6
    assert failed[0] == ([2], 6)
    assert {v.request_id for v in report.violations} == {2}
    assert "token_mismatch" in report.counts and "link_mismatch" in report.counts
