"""CanaryManager on CPU (reference path): the lagged pump, modes, attribution and misuse errors."""

from __future__ import annotations

import logging

import pytest
import torch

from kvcanary import CanaryConfig, CanaryGroup, Mode
from kvcanary.runtime import CanaryHealthError, CanaryManager, CanaryViolation, StepReport
from runtime_helpers import CAPS, NUM_SLOTS, Workload, alias_first_slot, drive, make_manager, run_step

# ---------------------------------------------------------------------- the lagged pump


def test_clean_run_is_silent_and_counts(caplog: pytest.LogCaptureFixture) -> None:
    mgr = make_manager(Mode.RAISE)
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        assert drive(mgr, 6) == [None] * 6
        assert mgr.flush() is None
    assert not caplog.records
    s = mgr.stats()
    assert s["steps"] == 6 and s["forwards"] == 6 and s["violations"] == 0 and s["skipped_entries"] == 0
    assert s["stamped"] == 2 * (4 + 5)
    # verified: step k verifies both prefixes: 0 at k=0, then 4, 5, 6, 7, 8 per row
    assert s["verified_slots"] == 2 * (4 + 5 + 6 + 7 + 8)


@pytest.mark.parametrize("fault_at", [2, 4])
def test_violation_at_step_k_is_reported_at_k_plus_1(fault_at: int) -> None:
    mgr = make_manager(Mode.LOG)
    reports = drive(mgr, 6, fault_at=fault_at)
    hits = [i for i, r in enumerate(reports) if r is not None]
    assert hits[0] == fault_at + 1
    first = reports[fault_at + 1]
    assert first is not None and first.step == fault_at and first.reported_at == fault_at + 1
    assert first.counts.get("link_mismatch", 0) >= 1


def test_flush_drains_the_last_step() -> None:
    mgr = make_manager(Mode.LOG)
    reports = drive(mgr, 3, fault_at=2)
    assert reports == [None, None, None]
    report = mgr.flush()
    assert report is not None and report.step == 2 and report.reported_at == 3
    assert mgr.flush() is None


def test_request_attribution_follows_the_batch_row_of_that_step() -> None:
    mgr = make_manager(Mode.LOG)
    wl = Workload()
    assert run_step(mgr, wl.batch([(1, 4), (2, 4), (3, 4)]), ["a", "b", "c"]) is None
    alias_first_slot(wl, victim=3, owner=2)
    # step 1: the victim (table row 3) sits at batch row 0
    assert run_step(mgr, wl.batch([(3, 1), (1, 1), (2, 1)]), ["c", "a", "b"]) is None
    # step 2: the order changes again; the step-1 rows must still map through step 1's ids
    report = run_step(mgr, wl.batch([(2, 1), (3, 1), (1, 1)]), ["b", "c", "a"])
    assert report is not None and report.step == 1
    assert report.affected_request_ids == ("c",)
    assert {v.batch_row for v in report.violations} == {0}
    assert all(v.request_id == "c" and v.table_row == 3 for v in report.violations)
    report2 = mgr.flush()  # the fault persists, now at batch row 1
    assert report2 is not None and report2.affected_request_ids == ("c",)
    assert {v.batch_row for v in report2.violations} == {1}


def test_unknown_request_ids_are_none() -> None:
    mgr = make_manager(Mode.LOG)
    wl = Workload()
    run_step(mgr, wl.batch([(1, 4), (2, 4)]), None)
    alias_first_slot(wl, victim=2, owner=1)
    run_step(mgr, wl.batch([(1, 1), (2, 1)]), ["only-one-id"])
    report = mgr.flush()
    assert report is not None and report.affected_request_ids == ()
    assert all(v.request_id is None for v in report.violations)


def test_truth_mismatch_names_the_reason_and_values() -> None:
    mgr = make_manager(Mode.LOG)
    wl = Workload()
    run_step(mgr, wl.batch([(1, 4)], truth=True), ["a"])
    slot = int(wl.table[1, 2])
    mgr.canaries["full"].records.tokens[slot] += 1  # the record no longer holds the scheduler's token
    run_step(mgr, wl.batch([(1, 1)], truth=True), ["a"])
    report = mgr.flush()
    assert report is not None
    (v,) = [v for v in report.violations if v.slot == slot]
    assert "token_mismatch" in v.reasons and "link_mismatch" in v.reasons
    assert v.phase == "verify" and v.expected_position == 2 and v.expected_token == Workload.token(1, 2)
    assert v.stored_token == Workload.token(1, 2) + 1


# ---------------------------------------------------------------------- modes


def test_mode_off_runs_nothing() -> None:
    mgr = make_manager(Mode.OFF)
    assert mgr.canaries == {}
    wl = Workload()
    # even a batch for an unknown group is ignored: nothing runs
    mgr.before_forward({"nope": wl.batch([(1, 4)])})
    mgr.after_forward()
    assert mgr.host_step(["a"]) is None and mgr.flush() is None
    assert mgr.stats()["forwards"] == 0 and mgr.metrics_registry is None


def test_mode_log_logs_lines_and_block_and_keeps_serving(caplog: pytest.LogCaptureFixture) -> None:
    mgr = make_manager(Mode.LOG)
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        reports = drive(mgr, 4, fault_at=2)
    report = reports[3]
    assert report is not None
    messages = [r.getMessage() for r in caplog.records]
    lines = [m for m in messages if m.startswith("kvcanary violation: ")]
    assert lines == report.lines() and len(lines) == len(report.violations) >= 1
    assert any(m.startswith(f"kvcanary: {report.total} violation(s) at step 2") for m in messages)
    assert "request='req-b'" in lines[0] and "group=full" in lines[0] and "step=2" in lines[0]


def test_log_output_is_rate_limited() -> None:
    now = [0.0]
    mgr = CanaryManager(
        [CanaryGroup(num_slots=NUM_SLOTS, name="full")],
        CAPS,
        CanaryConfig(mode=Mode.LOG, log_rate_limit_per_s=1.0),
        clock=lambda: now[0],
    )
    wl = Workload()
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("kvcanary").addHandler(handler)
    try:
        run_step(mgr, wl.batch([(1, 4), (2, 4)]), ["a", "b"])
        alias_first_slot(wl, victim=2, owner=1)
        blocks = []
        for k in range(6):
            now[0] = 0.3 * k  # six reports within 1.8 s: two blocks pass
            assert run_step(mgr, wl.batch([(1, 1), (2, 1)]), ["a", "b"]) is not None or k == 0
            blocks = [r.getMessage() for r in records if r.getMessage().startswith("kvcanary: ")]
        assert len(blocks) == 2
        assert "earlier report(s) suppressed" in blocks[1]
    finally:
        logging.getLogger("kvcanary").removeHandler(handler)


def test_mode_raise_carries_every_row_of_the_step() -> None:
    mgr = make_manager(Mode.RAISE)
    wl = Workload()
    run_step(mgr, wl.batch([(1, 4), (2, 4), (3, 4)]), ["a", "b", "c"])
    alias_first_slot(wl, victim=2, owner=1)
    alias_first_slot(wl, victim=3, owner=1)
    run_step(mgr, wl.batch([(1, 1), (2, 1), (3, 1)]), ["a", "b", "c"])
    with pytest.raises(CanaryViolation) as info:
        run_step(mgr, wl.batch([(1, 1), (2, 1), (3, 1)]), ["a", "b", "c"])
    report = info.value.report
    assert report.step == 1 and report.affected_request_ids == ("b", "c")
    assert len(report.violations) == report.total and report.rows_dropped == 0
    assert "kvcanary violation" not in str(info.value) and "violation(s) at step 1" in str(info.value)
    # the manager stays usable: the next step reports the persisting fault again
    with pytest.raises(CanaryViolation):
        mgr.flush()


def test_mode_fail_request_hands_ids_to_the_callback_and_continues() -> None:
    calls: list[tuple[list[object], StepReport]] = []
    mgr = make_manager(Mode.FAIL_REQUEST, on_fail_request=lambda ids, rep: calls.append((ids, rep)))
    reports = drive(mgr, 5, fault_at=2)
    assert [r is not None for r in reports] == [False, False, False, True, True]
    assert [ids for ids, _ in calls] == [["req-b"], ["req-b"]]
    assert calls[0][1] is reports[3]


def test_fail_request_needs_a_callback() -> None:
    with pytest.raises(ValueError, match="on_fail_request"):
        make_manager(Mode.FAIL_REQUEST)


def test_two_groups_report_separately() -> None:
    groups = [CanaryGroup(num_slots=NUM_SLOTS, name="full"), CanaryGroup(num_slots=NUM_SLOTS, group_id=1, name="draft")]
    mgr = CanaryManager(groups, {"full": CAPS, "draft": CAPS}, CanaryConfig(mode=Mode.LOG))
    wl_full, wl_draft = Workload(), Workload()

    def step(plan: list[tuple[int, int]]) -> StepReport | None:
        mgr.before_forward({"full": wl_full.batch(plan), "draft": wl_draft.batch(plan)})
        mgr.after_forward()
        return mgr.host_step(["a", "b"])

    step([(1, 4), (2, 4)])
    alias_first_slot(wl_draft, victim=2, owner=1)
    step([(1, 1), (2, 1)])
    report = step([(1, 1), (2, 1)])
    assert report is not None and set(report.group_counts) == {"draft"}
    assert {v.group for v in report.violations} == {"draft"} and {v.group_id for v in report.violations} == {1}


def test_rows_beyond_the_log_are_counted_as_dropped() -> None:
    mgr = make_manager(Mode.LOG, log_rows=2)
    wl = Workload()
    run_step(mgr, wl.batch([(1, 8), (2, 8)]), ["a", "b"])
    for p in range(8):  # every record of row 2 claims the wrong position
        mgr.canaries["full"].records.positions[int(wl.table[2, p])] += 1
    run_step(mgr, wl.batch([(1, 1), (2, 1)]), ["a", "b"])
    report = mgr.flush()
    assert report is not None and report.total == 8 and len(report.violations) == 4 and report.rows_dropped == 4
    assert report.counts["position_mismatch"] == 8


# ---------------------------------------------------------------------- misuse


def _records(mgr: CanaryManager) -> list[torch.Tensor]:
    out = []
    for c in mgr.canaries.values():
        out += [c.records.tokens.clone(), c.records.positions.clone(), c.records.links.clone()]
    return out


def _unchanged(mgr: CanaryManager, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, _records(mgr), strict=True))


def test_host_step_without_a_forward_names_the_problem() -> None:
    mgr = make_manager()
    with pytest.raises(RuntimeError, match="host_step called without a forward"):
        mgr.host_step(["a"])
    run_step(mgr, Workload().batch([(1, 2)]), ["a"])
    with pytest.raises(RuntimeError, match="host_step called without a forward"):
        mgr.host_step(["a"])


def test_misordered_calls_name_the_problem() -> None:
    mgr = make_manager()
    wl = Workload()
    with pytest.raises(RuntimeError, match="after_forward called without before_forward"):
        mgr.after_forward()
    mgr.before_forward({"full": wl.batch([(1, 2)])})
    snapshot = _records(mgr)
    retry = wl.batch([(1, 1)])
    with pytest.raises(RuntimeError, match="before_forward called twice"):
        mgr.before_forward({"full": retry})
    with pytest.raises(RuntimeError, match="host_step called between before_forward and after_forward"):
        mgr.host_step(["a"])
    with pytest.raises(RuntimeError, match="flush called between"):
        mgr.flush()
    assert _unchanged(mgr, snapshot)
    mgr.abandon_forward()
    mgr.before_forward({"full": retry})
    mgr.after_forward()
    with pytest.raises(RuntimeError, match="call host_step"):
        mgr.flush()
    assert mgr.host_step(["a"]) is None
    assert mgr.flush() is None  # the abandoned forward left the phase marks paired
    assert mgr.stats()["forwards"] == 2 and mgr.stats()["health_failures"] == 0


def test_bad_batches_raise_before_any_device_work() -> None:
    groups = [CanaryGroup(num_slots=NUM_SLOTS, name="full"), CanaryGroup(num_slots=NUM_SLOTS, group_id=1, name="swa")]
    mgr = CanaryManager(groups, CAPS, CanaryConfig(mode=Mode.RAISE))
    wl, wl2 = Workload(), Workload()
    mgr.before_forward({"full": wl.batch([(1, 4)]), "swa": wl2.batch([(1, 4)])})
    mgr.after_forward()
    mgr.host_step(["a"])
    snapshot = _records(mgr)
    good = wl.batch([(1, 1)])
    with pytest.raises(ValueError, match=r"unknown groups \['sliding'\], missing groups \['swa'\]"):
        mgr.before_forward({"full": good, "sliding": good})
    with pytest.raises(ValueError, match=r"missing groups \['swa'\]"):
        mgr.before_forward({"full": good})
    with pytest.raises(TypeError, match="batches must be a mapping"):
        mgr.before_forward([good])  # type: ignore[arg-type]
    # the second group is over capacity: the first group must not have been stamped either
    big = Workload().batch([(r, 1) for r in range(1, 6)] + [(0, 1)] * 4)
    with pytest.raises(ValueError, match=r"group 'swa'.*max_batch=8"):
        mgr.before_forward({"full": good, "swa": big})
    too_many_tokens = Workload().batch([(1, 30), (2, 30), (3, 30)])
    with pytest.raises(ValueError, match="max_tokens=64"):
        mgr.before_forward({"full": too_many_tokens, "swa": good})
    assert _unchanged(mgr, snapshot)
    assert mgr.flush() is None and mgr.stats()["forwards"] == 1  # no phase mark from the refused calls
    # the manager still works and the records were not disturbed: a clean step stays clean
    mgr.before_forward({"full": good, "swa": wl2.batch([(1, 1)])})
    mgr.after_forward()
    assert mgr.host_step(["a"]) is None and mgr.flush() is None


def test_constructor_errors_name_the_argument() -> None:
    g = CanaryGroup(num_slots=NUM_SLOTS, name="full")
    with pytest.raises(ValueError, match="groups is empty"):
        CanaryManager([], CAPS, CanaryConfig())
    with pytest.raises(ValueError, match="unique"):
        CanaryManager([g, g], CAPS, CanaryConfig())
    with pytest.raises(ValueError, match=r"missing \['full'\]"):
        CanaryManager([g], {"swa": CAPS}, CanaryConfig())
    with pytest.raises(TypeError, match="config"):
        CanaryManager([g], CAPS, "log")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="request_ids"):
        mgr = CanaryManager([g], CAPS, CanaryConfig())
        mgr.before_forward({"full": Workload().batch([(1, 1)])})
        mgr.after_forward()
        mgr.host_step("ab")


def test_health_error_and_violation_types() -> None:
    assert issubclass(CanaryHealthError, RuntimeError) and issubclass(CanaryViolation, Exception)
