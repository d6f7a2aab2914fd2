"""Reports point at the culprit, print only computed values and log each row once (issue 10, item 8)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import pytest

from kvcanary import Mode
from kvcanary.runtime import StepReport, Violation
from runtime_helpers import Workload, make_manager, run_step


def _aliased(position: int, caplog: pytest.LogCaptureFixture | None = None) -> StepReport:
    """req-b's entry at ``position`` points at req-a's slot there (same position, another prefix); no truth."""
    mgr = make_manager(Mode.LOG)
    wl = Workload()
    run_step(mgr, wl.batch([(1, 4), (2, 4)]), ["req-a", "req-b"])
    wl.table[2, position] = wl.table[1, position]
    run_step(mgr, wl.batch([(1, 1), (2, 1)]), ["req-a", "req-b"])
    with caplog.at_level(logging.WARNING, logger="kvcanary") if caplog else contextlib.nullcontext():
        report = run_step(mgr, wl.batch([(1, 1), (2, 1)]), ["req-a", "req-b"])
    assert report is not None
    return report


def test_a_wrong_entry_at_position_0_is_named_through_its_successor() -> None:
    report = _aliased(0)
    (v,) = report.violations  # position 0 passes its own check: only its successor's link fails
    assert (v.expected_position, v.reasons) == (1, ("link_mismatch",))
    assert v.note.startswith("likely culprit: the predecessor entry at position 0")
    assert f"(slot {v.pred})" in v.note
    assert "likely culprit: the predecessor entry at position 0" in report.block()
    assert "position 1: likely culprit: the predecessor entry at position 0" in report.summary()


def test_a_wrong_entry_inside_the_chain_is_the_culprit_and_its_successor_a_consequence() -> None:
    report = _aliased(2)
    notes = {v.expected_position: v.note for v in report.violations}
    assert sorted(notes) == [2, 3]
    assert notes[2].startswith("likely culprit: this entry")
    assert notes[3].startswith("consequence of the flagged entry at position 2")


def _row(**kw: object) -> Violation:
    base = dict(
        reasons=("link_mismatch",), reason_bits=1, phase="verify", group="swa", group_id=1, batch_row=0,
        request_id="r", table_row=1, slot=9, pred=0, expected_position=12, stored_position=12,
        expected_token=-1, stored_token=4, expected_link=0, stored_link=0x1235, bad_index=-1,
    )  # fmt: skip
    base.update(kw)
    return Violation(**base)


def test_values_that_were_not_computed_are_not_printed() -> None:
    sliding = _row(reasons=("position_mismatch",), reason_bits=2, stored_position=4).describe()
    assert "0x0000000000000000" not in sliding and "predecessor slot: 0" not in sliding
    assert "expected: token=unknown position=12" in sliding
    never = _row(reasons=("never_written",), reason_bits=8, stored_link=0, stored_token=0).describe()
    assert "stored: nothing (never written)" in never
    plan = _row(phase="plan", reasons=("length_out_of_range",), slot=-1, pred=-1, expected_position=-4).describe()
    assert "slot -1" not in plan and "prefix_len=-4" in plan
    linked = _row(expected_link=0x77, pred=5).describe()
    assert "link=0x0000000000000077 from predecessor slot 5" in linked


def test_log_mode_logs_each_row_once(caplog: pytest.LogCaptureFixture) -> None:
    report = _aliased(2, caplog)
    messages = [r.getMessage() for r in caplog.records]
    for v, line in zip(report.violations, report.lines(), strict=True):
        head = v.describe().splitlines()[0]
        assert sum(m.count(line) for m in messages) == 1
        assert not any(head in m for m in messages), "the row was logged twice (line and paragraph)"
    assert sum(m.startswith(f"kvcanary: {report.total} violation(s)") for m in messages) == 1


def test_event_carries_the_note(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from kvcanary.runtime.events import violation_event

    v = dataclasses.replace(_row(), note="likely culprit: x")
    assert violation_event(v, 1, 2, 0.0)["note"] == "likely culprit: x"
