"""The detection matrix: a text table for people, a JSON document for tools, one pass/fail verdict."""

from __future__ import annotations

import statistics
from typing import Any

from kvcanary.selftest.protocol import Expect
from kvcanary.selftest.runner import FaultRow, SelftestResult


def _steps(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:g}"


def row_json(row: FaultRow, engine: str) -> dict[str, Any]:
    spec = row.spec
    raw = [t.raw_steps for t in row.trials if t.raw_steps is not None and t.outcome in ("caught", "late")]
    return {
        "fault": spec.name,
        "engine": engine,
        "trials": len(row.trials),
        "detected": row.detected,
        "expected": spec.expected.value,
        "check": spec.check,
        "bug_class": spec.bug_class,
        "catalogue": spec.catalogue,
        "mechanism": spec.mechanism,
        "why_miss": spec.why_miss or None,
        "median_steps": row.median_steps,
        "median_raw_steps": statistics.median(raw) if raw else None,
        "late": row.count("late"),
        "missed": row.count("missed"),
        "errors": row.count("error"),
        "caught_before_any_read": row.not_affected,
        "expected_check_fired": sum(t.expected_check for t in row.trials),
        "attributed": sum(t.attributed for t in row.trials),
        "false_reports": sum(t.false_reports for t in row.trials),
        "no_effect_redrawn": row.no_effect,
        "unobservable_redrawn": row.unobservable,
        "fired": row.fired,
    }


def as_json(result: SelftestResult, seed: int) -> dict[str, Any]:
    return {
        "engine": result.engine,
        "engine_version": result.engine_version,
        "seed": seed,
        "trials_per_fault": result.requested_trials,
        "seconds": round(result.seconds, 1),
        "passed": result.passed,
        "results": [row_json(r, result.engine) for r in result.rows],
        "controls": {
            "runs": len(result.controls),
            "false_positives": result.false_positives,
            "errors": result.control_errors,
        },
    }


def table(result: SelftestResult, seed: int) -> str:
    head = ("fault", "bug class", "expected", "expected check", "trials", "detected", "median steps")
    rows = [
        (
            r.spec.name,
            r.spec.bug_class,
            r.spec.expected.value,
            r.spec.check,
            str(len(r.trials)),
            f"{r.detected}/{len(r.trials)}",
            _steps(r.median_steps),
        )
        for r in result.rows
    ]
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]
    right = {4, 5, 6}

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    runs = sum(len(r.trials) + r.no_effect + r.unobservable for r in result.rows) + len(result.controls)
    out = [
        f"kvcanary selftest: {result.engine_label}, {result.requested_trials} trials per fault, seed {seed}",
        "",
        line(head),
        line(tuple("-" * w for w in widths)),
        *(line(r) for r in rows),
        "",
        f"controls: {len(result.controls)} clean runs, {result.false_positives} false positive(s)"
        + (f", {result.control_errors} with errors" if result.control_errors else ""),
    ]
    notes = _notes(result)
    if notes:
        out += ["", *notes]
    misses = [r for r in result.rows if r.spec.expected is Expect.MISS]
    if misses:
        out += ["", "expected misses (no token/position/link check can see them):"]
        out += [f"  {r.spec.name}: {r.spec.why_miss}" for r in misses]
    out += [
        "",
        "steps: from the first read of corrupted KV (an independent oracle compares what attention received with "
        "a clean run) to the canary's report, counting the affected requests' forwards; <= 0 caught at or "
        "before that read, 1 by the next.",
        f"{runs} engine runs in {result.seconds:.0f} s.",
        "",
        verdict(result),
    ]
    return "\n".join(out)


def _notes(result: SelftestResult) -> list[str]:
    notes = []
    for r in result.rows:
        bad = {k: r.count(k) for k in ("late", "missed", "error") if r.count(k)}
        if r.spec.expected is Expect.DETECT and bad:
            notes.append(f"{r.spec.name}: " + ", ".join(f"{v} {k}" for k, v in bad.items()))
        other = sum(not t.expected_check for t in r.trials if t.outcome == "caught")
        if r.spec.expected is Expect.DETECT and other:
            notes.append(f"{r.spec.name}: caught by another check than documented in {other} trial(s): {r.fired}")
        if r.spec.expected is Expect.MISS and r.detected:
            notes.append(f"{r.spec.name}: detected in {r.detected} trial(s) although expected to be missed")
        if len(r.trials) < result.requested_trials:
            notes.append(
                f"{r.spec.name}: only {len(r.trials)} of {result.requested_trials} trials found an eligible step"
            )
        false = sum(t.false_reports for t in r.trials)
        if false:
            notes.append(f"{r.spec.name}: {false} report(s) before the fault was injected (false positives)")
        for t in r.trials:
            if t.errors:
                notes.append(f"{r.spec.name}, seed {t.seed}: {t.errors[0]}")
                break
    for c in result.controls:
        if c.false_positive or c.errors:
            what = c.errors[0] if c.errors else f"{c.violations} violation row(s)"
            notes.append(f"control {c.kind} seed {c.seed}: {what}")
    return notes


def verdict(result: SelftestResult) -> str:
    if result.passed:
        return (
            "result: PASS (every 'detect' fault caught in every trial, within one step of its first affected read; "
            "the controls raised nothing)"
        )
    failing = [r.spec.name for r in result.rows if not r.passed or len(r.trials) < result.requested_trials]
    why = []
    if failing:
        why.append("faults not caught every time by their documented check: " + ", ".join(failing))
    if result.false_positives:
        why.append(f"{result.false_positives} control run(s) raised violations")
    if result.control_errors:
        why.append(f"{result.control_errors} control run(s) failed")
    return "result: FAIL (" + "; ".join(why) + ")"
