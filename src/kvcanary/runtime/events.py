"""JSON-lines event log: one JSON object per line, appended to ``CanaryConfig.events_path``.

Schema version 1.  Every event has ``"schema": 1``, ``"event"`` (its kind), ``"time"`` (Unix
seconds, float) and ``"step"`` (the host step the event is about).  Kinds:

``violation`` (one per decoded violation row)
    ``reported_at`` (int, the host step that decoded it), ``group`` (str), ``group_id`` (int),
    ``phase`` (``"plan"``/``"verify"``/``"stamp"``), ``reasons`` (list of str), ``reason_bits``
    (int), ``batch_row`` (int), ``request_id`` (int, str, float, bool or null; other objects as
    ``str()``), ``table_row``, ``slot``, ``pred``, ``expected_position``, ``stored_position``,
    ``expected_token``, ``stored_token``, ``bad_index`` (int, -1 = none/unknown),
    ``expected_link``, ``stored_link`` (str, ``"0x"`` + 16 hex digits, unsigned), ``note`` (str,
    the report's culprit reading of the row, ``""`` when none; see ``runtime/culprit.py``).

``step`` (one per host step that had violations, after its ``violation`` events)
    ``reported_at`` (int), ``total`` (int, rows counted on device), ``rows_kept`` (int),
    ``rows_dropped`` (int), ``counts`` (object: reason name -> count), ``group_counts`` (object:
    group name -> rows), ``affected_request_ids`` (list).

``health`` (a failed health or phase check)
    ``check`` (``"kernels_ran"`` or ``"phase"``), ``group`` (str or null), ``detail`` (str).

``stats`` (every ``CanaryConfig.stats_every`` steps)
    ``forwards``, ``verified_slots``, ``stamped``, ``violations``, ``skipped_entries``,
    ``health_failures`` (int, cumulative as of ``step``).

Readers must ignore keys they do not know; new keys may be added without a schema bump.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from kvcanary.runtime.report import StepReport, Violation

SCHEMA_VERSION = 1

logger = logging.getLogger("kvcanary")


def json_id(rid: object) -> object:
    if rid is None or isinstance(rid, (bool, int, float, str)):
        return rid
    return str(rid)


def violation_event(v: Violation, step: int, reported_at: int, now: float) -> dict[str, Any]:
    return {
        "schema": SCHEMA_VERSION,
        "event": "violation",
        "time": now,
        "step": step,
        "reported_at": reported_at,
        "group": v.group,
        "group_id": v.group_id,
        "phase": v.phase,
        "reasons": list(v.reasons),
        "reason_bits": v.reason_bits,
        "batch_row": v.batch_row,
        "request_id": json_id(v.request_id),
        "table_row": v.table_row,
        "slot": v.slot,
        "pred": v.pred,
        "expected_position": v.expected_position,
        "stored_position": v.stored_position,
        "expected_token": v.expected_token,
        "stored_token": v.stored_token,
        "expected_link": f"0x{v.expected_link:016x}",
        "stored_link": f"0x{v.stored_link:016x}",
        "bad_index": v.bad_index,
        "note": v.note,
    }


def step_event(report: StepReport, now: float) -> dict[str, Any]:
    return {
        "schema": SCHEMA_VERSION,
        "event": "step",
        "time": now,
        "step": report.step,
        "reported_at": report.reported_at,
        "total": report.total,
        "rows_kept": len(report.violations),
        "rows_dropped": report.rows_dropped,
        "counts": dict(report.counts),
        "group_counts": dict(report.group_counts),
        "affected_request_ids": [json_id(r) for r in report.affected_request_ids],
    }


class EventLog:
    """Appends events to a file.

    Events are rare (violations, failed checks, periodic stats), so each write opens the file in
    append mode and closes it again: nothing is lost on a crash and no handle outlives a write.
    The constructor opens the file once, so a bad path fails at install time.  Bounded: a write that
    would take the file past ``max_bytes`` first renames it to ``<path>.1`` (replacing the previous
    one), so a violation storm holds at most about twice ``max_bytes`` on disk; whole events only, so
    both files stay valid JSON lines.  ``max_bytes`` 0: unbounded.  A step writes at most one report's
    events (2 K rows a group, then the step event).  A write that fails (full disk, removed directory)
    drops its events, counts them in :attr:`dropped` and logs once: the engine's step goes on.
    """

    def __init__(self, path: str, max_bytes: int = 0) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.path = path
        self.max_bytes = max_bytes
        self.rotations = 0
        self.dropped = 0  # events lost to write errors (logged once)
        self._closed = False
        with open(path, "a", encoding="utf-8"):
            pass
        self._size = os.path.getsize(path)

    def write(self, events: list[dict[str, Any]]) -> None:
        if self._closed or not events:
            return
        payload = "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in events).encode()
        try:
            if self.max_bytes and self._size and self._size + len(payload) > self.max_bytes:
                os.replace(self.path, self.path + ".1")
                self.rotations += 1
                self._size = 0
            with open(self.path, "ab") as f:
                f.write(payload)
        except OSError as exc:  # a full disk or a removed directory must not stop the engine's step
            self.dropped += len(events)
            if self.dropped == len(events):
                logger.error(
                    "kvcanary: could not write the event log %s (%s); events are dropped and counted", self.path, exc
                )
            return
        self._size += len(payload)

    def report(self, report: StepReport) -> None:
        now = time.time()
        events = [violation_event(v, report.step, report.reported_at, now) for v in report.violations]
        events.append(step_event(report, now))
        self.write(events)

    def health(self, step: int, check: str, group: str | None, detail: str) -> None:
        event = {"check": check, "group": group, "detail": detail}
        self.write([{"schema": SCHEMA_VERSION, "event": "health", "time": time.time(), "step": step, **event}])

    def stats(self, step: int, stats: dict[str, int]) -> None:
        self.write([{"schema": SCHEMA_VERSION, "event": "stats", "time": time.time(), "step": step, **stats}])

    def close(self) -> None:
        self._closed = True
