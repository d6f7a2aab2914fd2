"""``kvcanary report EVENTS.jsonl``: the event log, summed up for an operator (the CLI stays thin)."""

from __future__ import annotations

import argparse
import json

EPILOG = """exit codes:
  0  the log was read and records no violation and no failed health check
  1  the log records violations or failed health checks (the summary says which)
  2  bad command-line usage, or the file is missing, not an event log, or of another schema version
  3  the environment cannot run it (--plot without matplotlib)
"""


HELP = "summarise a JSON-lines event log (CanaryConfig(events_path=...)): counts, timeline, first violations"
DESCRIPTION = (
    "Reads the event log the runtime appends to CanaryConfig.events_path (schema version 1) and "
    "prints violation rows by reason, group and request, the timeline (rows per step), failed health "
    "checks and the first violations in full."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("events", metavar="EVENTS.jsonl", help="the event log")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON document")
    p.add_argument("--first", type=int, default=5, metavar="N", help="violations shown in full (default: 5)")
    p.add_argument("--plot", metavar="FILE.png", help="also draw the timeline into FILE.png (needs matplotlib)")


def run(args: argparse.Namespace) -> int:
    from kvcanary.cli_checks import EXIT_CHECK_FAILED, EXIT_ENVIRONMENT, EXIT_OK, EXIT_USAGE, fail
    from kvcanary.events_report import EventLogError, as_json, read_summary, render

    if args.first < 0:
        return fail(f"kvcanary report: --first must be >= 0, got {args.first}", EXIT_USAGE)
    try:
        summary = read_summary(args.events)
    except EventLogError as exc:
        return fail(f"kvcanary report: {exc}", EXIT_USAGE)
    if args.plot:
        from kvcanary.plots import PlotsUnavailable, events_timeline

        try:
            events_timeline(summary, args.plot)
        except PlotsUnavailable as exc:
            return fail(f"kvcanary report: {exc}", EXIT_ENVIRONMENT)
        except OSError as exc:
            return fail(f"kvcanary report: cannot write {args.plot}: {exc}", EXIT_USAGE)
    if args.json:
        print(json.dumps(as_json(summary, args.first)))
    else:
        print(render(summary, args.first))
        if args.plot:
            print(f"\ntimeline written to {args.plot}")
    return EXIT_OK if summary.clean else EXIT_CHECK_FAILED
