"""The event log never stops the step: a write that fails (the directory is gone) drops and counts its events."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from kvcanary import Mode
from runtime_helpers import Workload, alias_first_slot, make_manager, run_step


def test_a_failing_event_log_drops_and_counts_events_and_serving_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "events"
    folder.mkdir()
    path = folder / "events.jsonl"
    mgr = make_manager(Mode.LOG, health_every=0, events_path=str(path), log_rate_limit_per_s=1e9)
    wl = Workload()
    run_step(mgr, wl.batch([(1, 4), (2, 4)]), ["a", "b"])
    alias_first_slot(wl, victim=2, owner=1)
    assert run_step(mgr, wl.batch([(1, 1), (2, 1)]), ["a", "b"]) is None  # decoded next step
    first = run_step(mgr, wl.batch([(1, 1), (2, 1)]), ["a", "b"])
    assert first is not None and path.read_text().count('"event":"step"') == 1
    shutil.rmtree(folder)  # every later write fails
    with caplog.at_level(logging.ERROR, logger="kvcanary"):
        reports = [run_step(mgr, wl.batch([(1, 1), (2, 1)]), ["a", "b"]) for _ in range(5)]
        reports.append(mgr.flush())
    assert all(r is not None for r in reports)  # every step still decoded and reported
    events = mgr._decoder.events
    assert events is not None
    assert events.dropped == sum(len(r.violations) + 1 for r in reports if r is not None)
    errors = [r.getMessage() for r in caplog.records if "could not write the event log" in r.getMessage()]
    assert len(errors) == 1 and str(path) in errors[0]
