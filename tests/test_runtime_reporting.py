"""What the runtime emits: the stable log line, the JSON-lines events and the Prometheus counters."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from kvcanary import CanaryConfig, CanaryGroup, Mode
from kvcanary.runtime import CanaryManager, Violation
from runtime_helpers import CAPS, NUM_SLOTS, Workload, alias_first_slot, drive, make_manager, run_step

LINE = re.compile(
    r"kvcanary violation: step=(?P<step>\d+) group=(?P<group>\S+) phase=(?P<phase>plan|verify|stamp) "
    r"reasons=(?P<reasons>[a-z_]+(?:\+[a-z_]+)*) request=(?P<request>\S+) batch_row=(?P<batch_row>-?\d+) "
    r"table_row=(?P<table_row>-?\d+) slot=(?P<slot>-?\d+) pred=(?P<pred>-?\d+) position=(?P<position>-?\d+) "
    r"stored_position=(?P<stored_position>-?\d+) token=(?P<token>-?\d+) stored_token=(?P<stored_token>-?\d+) "
    r"link=0x(?P<link>[0-9a-f]{16}) stored_link=0x(?P<stored_link>[0-9a-f]{16}) bad_index=(?P<bad_index>-?\d+)$"
)


def _violation(**kw: object) -> Violation:
    base: dict[str, object] = dict(
        reasons=("link_mismatch", "position_mismatch"),
        reason_bits=3,
        phase="verify",
        group="full",
        group_id=0,
        batch_row=1,
        request_id="req-7",
        table_row=4,
        slot=37,
        pred=36,
        expected_position=5,
        stored_position=6,
        expected_token=-1,
        stored_token=42,
        expected_link=0xFFFF_0000_0000_0001,
        stored_link=0x1,
        bad_index=-1,
    )
    base.update(kw)
    return Violation(**base)  # type: ignore[arg-type]


def test_line_format_is_stable() -> None:
    line = _violation().line(12)
    assert line == (
        "kvcanary violation: step=12 group=full phase=verify reasons=link_mismatch+position_mismatch "
        "request='req-7' batch_row=1 table_row=4 slot=37 pred=36 position=5 stored_position=6 token=-1 "
        "stored_token=42 link=0xffff000000000001 stored_link=0x0000000000000001 bad_index=-1"
    )
    m = LINE.match(line)
    assert m is not None and m["reasons"] == "link_mismatch+position_mismatch"
    assert LINE.match(_violation(request_id=None).line(0)) is not None
    assert "request=-" in _violation(request_id=None).line(0)


def test_logged_lines_parse(caplog: pytest.LogCaptureFixture) -> None:
    mgr = make_manager(Mode.LOG)
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        drive(mgr, 4, fault_at=2)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kvcanary violation:")]
    assert lines
    for line in lines:
        m = LINE.match(line)
        assert m is not None, line
        assert m["step"] == "2" and m["request"] == "'req-b'" and m["batch_row"] == "1"


# ---------------------------------------------------------------------- events

VIOLATION_KEYS = {
    "schema": int, "event": str, "time": float, "step": int, "reported_at": int, "group": str, "group_id": int,
    "phase": str, "reasons": list, "reason_bits": int, "batch_row": int, "request_id": (str, int, type(None)),
    "table_row": int, "slot": int, "pred": int, "expected_position": int, "stored_position": int,
    "expected_token": int, "stored_token": int, "expected_link": str, "stored_link": str, "bad_index": int,
}  # fmt: skip
STEP_KEYS = {
    "schema": int, "event": str, "time": float, "step": int, "reported_at": int, "total": int, "rows_kept": int,
    "rows_dropped": int, "counts": dict, "group_counts": dict, "affected_request_ids": list,
}  # fmt: skip


def _events(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _check_keys(event: dict[str, object], keys: dict[str, object]) -> None:
    assert set(keys) <= set(event), set(keys) - set(event)
    for k, t in keys.items():
        assert isinstance(event[k], t), (k, event[k])  # type: ignore[arg-type]


def test_event_log_schema(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    mgr = make_manager(Mode.LOG, events_path=str(path), stats_every=2)
    reports = drive(mgr, 4, fault_at=2)
    mgr.flush()
    mgr.close()
    events = _events(path)
    assert all(e["schema"] == 1 for e in events)
    kinds = [e["event"] for e in events]
    viol = [e for e in events if e["event"] == "violation"]
    steps = [e for e in events if e["event"] == "step"]
    # two reports (steps 2 and 3), each: its violation rows, then one step summary
    report = reports[3]
    assert report is not None and len(steps) == 2 and len(viol) == 2 * len(report.violations)
    assert kinds.index("step") == len(report.violations) + kinds.index("violation")
    for e in viol:
        _check_keys(e, VIOLATION_KEYS)
        assert e["request_id"] == "req-b" and e["group"] == "full" and e["phase"] == "verify"
        assert re.fullmatch(r"0x[0-9a-f]{16}", e["stored_link"])  # type: ignore[arg-type]
        assert "link_mismatch" in e["reasons"]  # type: ignore[operator]
    for e in steps:
        _check_keys(e, STEP_KEYS)
        assert e["affected_request_ids"] == ["req-b"] and e["group_counts"] == {"full": e["total"]}
    assert [e["step"] for e in steps] == [2, 3] and [e["reported_at"] for e in steps] == [3, 4]
    first = viol[0]
    v = report.violations[0] if steps[0]["step"] == report.step else None
    assert v is not None and first["slot"] == v.slot and first["stored_link"] == f"0x{v.stored_link:016x}"
    stats = [e for e in events if e["event"] == "stats"]
    assert [e["step"] for e in stats] == [1, 3]
    assert {"forwards", "verified_slots", "stamped", "violations", "skipped_entries", "health_failures"} <= set(
        stats[0]
    )


def test_clean_run_writes_no_violation_events(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    mgr = make_manager(Mode.LOG, events_path=str(path))
    drive(mgr, 4)
    mgr.flush()
    mgr.close()
    assert _events(path) == []


def test_health_events(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    mgr = make_manager(Mode.LOG, events_path=str(path), health_every=0)
    run_step(mgr, Workload().batch([(1, 2)]), ["a"])
    mgr._graph_captured = True  # a "replay" without the canary's work follows
    mgr.host_step(["a"])
    mgr.flush()
    (event,) = _events(path)
    assert event["event"] == "health" and event["check"] == "phase" and event["group"] is None
    assert event["step"] == 1 and "no canary device work" in event["detail"]  # type: ignore[operator]


def test_non_json_request_ids_are_stringified(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    mgr = make_manager(Mode.LOG, events_path=str(path))
    wl = Workload()
    run_step(mgr, wl.batch([(1, 4), (2, 4)]), [("x", 1), ("y", 2)])
    alias_first_slot(wl, victim=2, owner=1)
    run_step(mgr, wl.batch([(1, 1), (2, 1)]), [("x", 1), ("y", 2)])
    report = mgr.flush()
    assert report is not None and report.affected_request_ids == (("y", 2),)
    steps = [e for e in _events(path) if e["event"] == "step"]
    assert steps[0]["affected_request_ids"] == ["('y', 2)"]


# ---------------------------------------------------------------------- Prometheus


def test_prometheus_counters_per_reason_and_group() -> None:
    pytest.importorskip("prometheus_client")
    mgr = make_manager(Mode.LOG)
    other = make_manager(Mode.LOG)  # a second manager: its own registry, no clash
    reg = mgr.metrics_registry
    assert reg is not None and other.metrics_registry is not None and reg is not other.metrics_registry
    drive(mgr, 4, fault_at=2)
    report = mgr.flush()
    assert report is not None
    get = reg.get_sample_value  # type: ignore[attr-defined]
    s = mgr.stats()
    assert get("kvcanary_violations_total", {"group": "full", "reason": "link_mismatch"}) == s["violations"] > 0
    assert get("kvcanary_violations_total", {"group": "full", "reason": "token_mismatch"}) == 0
    assert get("kvcanary_violation_rows_total", {"group": "full"}) == s["violations"]
    assert get("kvcanary_verified_slots_total", {"group": "full"}) == s["verified_slots"] > 0
    assert get("kvcanary_stamped_slots_total", {"group": "full"}) == s["stamped"]
    assert get("kvcanary_skipped_entries_total", {"group": "full"}) == 0
    assert get("kvcanary_steps_total", {}) == 4
    assert get("kvcanary_health_failures_total", {"check": "phase"}) == 0
    get_other = other.metrics_registry.get_sample_value  # type: ignore[attr-defined]
    assert get_other("kvcanary_violations_total", {"group": "full", "reason": "link_mismatch"}) == 0


def test_the_default_registry_is_left_alone() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    make_manager(Mode.LOG)
    names = {m.name for m in prometheus_client.REGISTRY.collect()}
    assert not any(n.startswith("kvcanary") for n in names)


def test_metrics_text_exposition() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    groups = [CanaryGroup(num_slots=NUM_SLOTS, name="full"), CanaryGroup(num_slots=NUM_SLOTS, group_id=1, name="swa")]
    mgr = CanaryManager(groups, CAPS, CanaryConfig(mode=Mode.LOG))
    text = prometheus_client.generate_latest(mgr.metrics_registry).decode()  # type: ignore[arg-type]
    assert 'kvcanary_violations_total{group="swa",reason="never_written"} 0.0' in text
    assert "kvcanary_steps_total 0.0" in text
