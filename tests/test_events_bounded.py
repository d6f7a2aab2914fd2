"""The event log stays bounded in a violation storm: it rotates whole events into one old file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcanary import CanaryConfig
from kvcanary.runtime.events import EventLog


def _lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_storm_rotates_into_one_old_file_and_every_line_stays_whole(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(str(path), max_bytes=4096)
    for step in range(2000):
        log.health(step, "kernels_ran", "full", "x" * 40)
    assert log.rotations > 10
    old = Path(str(path) + ".1")
    assert path.stat().st_size <= 4096 and old.stat().st_size <= 4096
    assert not (tmp_path / "events.jsonl.2").exists()
    newest, previous = _lines(path), _lines(old)
    steps = [e["step"] for e in previous + newest]
    assert steps == list(range(steps[0], 2000)), "the two files hold the newest events, in order, none cut"


def test_unbounded_when_zero_and_resumes_the_size_of_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text('{"schema": 1}\n' * 100)
    log = EventLog(str(path), max_bytes=0)
    for step in range(200):
        log.health(step, "phase", None, "detail")
    assert log.rotations == 0 and len(path.read_text().splitlines()) == 300
    bounded = EventLog(str(path), max_bytes=path.stat().st_size)  # already full: the next write rotates
    bounded.health(0, "phase", None, "detail")
    assert bounded.rotations == 1 and len(_lines(path)) == 1


def test_a_negative_cap_is_refused() -> None:
    with pytest.raises(ValueError, match="events_max_bytes must be >= 0"):
        CanaryConfig(events_max_bytes=-1)
    with pytest.raises(ValueError, match="max_bytes must be >= 0"):
        EventLog("/dev/null", max_bytes=-1)
