"""Reading the runtime's JSON-lines event log (:mod:`kvcanary.runtime.events`): what ``kvcanary report`` shows.

An operator gets a file of events from production and wants to know what went wrong, where and when:
counts by reason, group and request, the timeline (violation rows per step), health failures, and the
first violations in full.  Counts by reason and group come from the ``step`` events (rows counted on
device, including rows the log dropped); counts by request come from the ``violation`` events (the
rows kept), so they can sum to less when rows were dropped.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from pathlib import Path
from typing import Any

from kvcanary.runtime.events import SCHEMA_VERSION

EVENT_KINDS = ("violation", "step", "health", "stats")
DEFAULT_FIRST = 5  # violations shown in full


class EventLogError(ValueError):
    """The file is missing, unreadable, not an event log, or of another schema version."""


@dataclasses.dataclass(frozen=True)
class EventSummary:
    path: str
    events: int
    violations: list[dict[str, Any]]
    steps: list[dict[str, Any]]
    health: list[dict[str, Any]]
    stats: list[dict[str, Any]]
    unknown_kinds: int  # events of kinds this version does not know (ignored, as the schema asks)
    incomplete_tail: bool = False  # the last line was cut off (the writer was killed mid-line) and left out

    @property
    def clean(self) -> bool:
        return not self.steps and not self.violations and not self.health

    @property
    def rows_total(self) -> int:
        return sum(int(e.get("total", 0)) for e in self.steps)

    @property
    def rows_dropped(self) -> int:
        return sum(int(e.get("rows_dropped", 0)) for e in self.steps)

    def by_reason(self) -> dict[str, int]:
        return _sum_maps(e.get("counts", {}) for e in self.steps)

    def by_group(self) -> dict[str, int]:
        return _sum_maps(e.get("group_counts", {}) for e in self.steps)

    def by_request(self) -> dict[str, int]:
        """Kept violation rows per request id (ids written as JSON text so every kind of id is a key)."""
        counts = collections.Counter(json.dumps(e.get("request_id")) for e in self.violations)
        return dict(counts.most_common())

    def timeline(self) -> list[tuple[int, int]]:
        """(step, violation rows counted on device) for every step that had violations, in step order."""
        rows: collections.Counter[int] = collections.Counter()
        for e in self.steps:
            rows[int(e["step"])] += int(e.get("total", 0))
        return sorted(rows.items())


def _sum_maps(maps: Any) -> dict[str, int]:
    total: collections.Counter[str] = collections.Counter()
    for m in maps:
        if isinstance(m, dict):
            total.update({str(k): int(v) for k, v in m.items()})
    return dict(total.most_common())


def _parse_line(text: str, number: int, path: str) -> dict[str, Any]:
    try:
        event = json.loads(text)
    except json.JSONDecodeError as exc:
        raise EventLogError(f"{path}, line {number}: not a kvcanary event log (not JSON: {exc.msg})") from None
    if not isinstance(event, dict) or "schema" not in event or "event" not in event:
        raise EventLogError(f"{path}, line {number}: not a kvcanary event (no 'schema' and 'event' keys)")
    if event["schema"] != SCHEMA_VERSION:
        raise EventLogError(
            f"{path}, line {number}: event log schema version {event['schema']!r}; "
            f"this kvcanary reads version {SCHEMA_VERSION}"
        )
    if event["event"] in ("violation", "step", "health") and not isinstance(event.get("step"), int):
        raise EventLogError(f"{path}, line {number}: a {event['event']!r} event without an integer 'step'")
    return event


def _read_text(path: str | Path) -> str:
    name = str(path)
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise EventLogError(f"{name}: no such file") from None
    except IsADirectoryError:
        raise EventLogError(f"{name}: is a directory, not an event log") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise EventLogError(f"{name}: cannot read it ({exc})") from None


def load_events(path: str | Path) -> tuple[list[dict[str, Any]], bool]:
    """Every event of the log, in file order, and whether an incomplete last line was left out.

    The writer appends whole lines, so only a process killed mid-write leaves a last line without its
    newline; that line is skipped when it does not parse.  Any other bad line raises
    :class:`EventLogError` naming it.
    """
    text = _read_text(path)
    lines = text.splitlines()
    incomplete = bool(lines) and not text.endswith("\n")
    if incomplete:
        try:
            json.loads(lines[-1])
            incomplete = False
        except json.JSONDecodeError:
            lines.pop()
    events = [_parse_line(line, i, str(path)) for i, line in enumerate(lines, start=1) if line.strip()]
    return events, incomplete


def summarize(events: list[dict[str, Any]], path: str = "", incomplete_tail: bool = False) -> EventSummary:
    by_kind: dict[str, list[dict[str, Any]]] = {k: [] for k in EVENT_KINDS}
    unknown = 0
    for e in events:
        if e["event"] in by_kind:
            by_kind[e["event"]].append(e)
        else:
            unknown += 1
    return EventSummary(
        path=path,
        events=len(events),
        violations=by_kind["violation"],
        steps=by_kind["step"],
        health=by_kind["health"],
        stats=by_kind["stats"],
        unknown_kinds=unknown,
        incomplete_tail=incomplete_tail,
    )


def read_summary(path: str | Path) -> EventSummary:
    events, incomplete = load_events(path)
    return summarize(events, str(path), incomplete)


def as_json(s: EventSummary, first: int = DEFAULT_FIRST) -> dict[str, Any]:
    return {
        "path": s.path,
        "schema": SCHEMA_VERSION,
        "events": s.events,
        "clean": s.clean,
        "violation_rows": s.rows_total,
        "rows_kept": len(s.violations),
        "rows_dropped": s.rows_dropped,
        "steps_with_violations": len(s.timeline()),
        "by_reason": s.by_reason(),
        "by_group": s.by_group(),
        "by_request": s.by_request(),
        "timeline": [{"step": step, "rows": rows} for step, rows in s.timeline()],
        "health_failures": s.health,
        "last_stats": s.stats[-1] if s.stats else None,
        "first_violations": s.violations[:first],
        "unknown_events": s.unknown_kinds,
        "incomplete_last_line": s.incomplete_tail,
    }


def _counts_lines(title: str, counts: dict[str, int], limit: int = 10) -> list[str]:
    if not counts:
        return []
    width = max(len(k) for k in list(counts)[:limit])
    lines = [f"{title}:"]
    lines += [f"  {k.ljust(width)}  {v:>8,}" for k, v in list(counts.items())[:limit]]
    if len(counts) > limit:
        lines.append(f"  ... and {len(counts) - limit} more")
    return lines


def _violation_block(e: dict[str, Any]) -> list[str]:
    head = (
        f"step {e['step']} (reported at {e.get('reported_at', '?')}), group {e.get('group')!r}, "
        f"phase {e.get('phase')}, request {e.get('request_id')!r}: {'+'.join(e.get('reasons', []))}"
    )
    fields = ("batch_row", "table_row", "slot", "pred", "bad_index")
    pairs = [("position", "expected_position", "stored_position"), ("token", "expected_token", "stored_token")]
    pairs.append(("link", "expected_link", "stored_link"))
    detail = ", ".join(f"{f} {e.get(f)}" for f in fields if f in e)
    stored = "; ".join(f"{name} expected {e.get(x)} stored {e.get(y)}" for name, x, y in pairs if x in e)
    return [f"  {head}", f"    {detail}", f"    {stored}"]


def render(s: EventSummary, first: int = DEFAULT_FIRST) -> str:
    timeline = s.timeline()
    out = [f"kvcanary report: {s.path} ({s.events} events, schema {SCHEMA_VERSION})", ""]
    if s.clean:
        out.append("no violations and no failed health checks recorded")
    else:
        span = f"steps {timeline[0][0]}..{timeline[-1][0]}" if timeline else "no step"
        out.append(
            f"{s.rows_total:,} violation row(s) in {len(timeline)} step(s) ({span}); "
            f"{len(s.violations):,} kept in full, {s.rows_dropped:,} dropped (over the log's capacity)"
        )
    for title, counts in (("by reason", s.by_reason()), ("by group", s.by_group())):
        out += ["", *_counts_lines(title, counts)] if counts else []
    if s.violations:
        out += ["", *_counts_lines("by request (kept rows)", s.by_request())]
    if timeline:
        out += ["", "timeline (step: rows):", "  " + ", ".join(f"{step}: {rows}" for step, rows in timeline[:40])]
        out += [f"  ... and {len(timeline) - 40} more steps"] if len(timeline) > 40 else []
    if s.health:
        out += ["", f"failed health checks ({len(s.health)}):"]
        out += [f"  step {e['step']}: {e.get('check')} {e.get('group')!r}: {e.get('detail')}" for e in s.health[:10]]
    if s.violations:
        out += ["", f"first {min(first, len(s.violations))} violation(s):"]
        for e in s.violations[:first]:
            out += _violation_block(e)
    if s.stats:
        last = s.stats[-1]
        keys = [k for k in last if k not in ("schema", "event", "time", "step")]
        out += ["", f"last stats (step {last['step']}): " + ", ".join(f"{k} {last[k]}" for k in keys)]
    if s.unknown_kinds:
        out += ["", f"{s.unknown_kinds} event(s) of kinds this version does not know were ignored"]
    if s.incomplete_tail:
        out += ["", "the last line was cut off (the process was killed while writing it) and left out"]
    return "\n".join(out)
