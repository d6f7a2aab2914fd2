"""``kvcanary report EVENTS.jsonl``: the event log, summed up for an operator (the CLI stays thin)."""

from __future__ import annotations

import argparse
import json
import sys

EPILOG = """exit codes:
  0  the log was read and records no violation and no failed health check
  1  the log records violations or failed health checks (the summary says which)
  2  bad command-line usage, or the file is missing, not an event log, or of another schema version
  3  the environment cannot run it (--plot without matplotlib)
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from kvcanary.cli_checks import add_command

    p = add_command(
        sub,
        "report",
        help="summarise a JSON-lines event log (CanaryConfig(events_path=...)): counts, timeline, first violations",
        description="Reads the event log the runtime appends to CanaryConfig.events_path (schema version 1) and "
        "prints violation rows by reason, group and request, the timeline (rows per step), failed health "
        "checks and the first violations in full.",
        epilog=EPILOG,
    )
    p.add_argument("events", metavar="EVENTS.jsonl", help="the event log")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON document")
    p.add_argument("--first", type=int, default=5, metavar="N", help="violations shown in full (default: 5)")
    p.add_argument("--plot", metavar="FILE.png", help="also draw the timeline into FILE.png (needs matplotlib)")


def run(args: argparse.Namespace, exit_ok: int, exit_failed: int, exit_usage: int, exit_env: int) -> int:
    from kvcanary.events_report import EventLogError, as_json, read_summary, render

    if args.first < 0:
        print(f"kvcanary report: --first must be >= 0, got {args.first}", file=sys.stderr)
        return exit_usage
    try:
        summary = read_summary(args.events)
    except EventLogError as exc:
        print(f"kvcanary report: {exc}", file=sys.stderr)
        return exit_usage
    if args.plot:
        from kvcanary.plots import PlotsUnavailable, events_timeline

        try:
            events_timeline(summary, args.plot)
        except PlotsUnavailable as exc:
            print(f"kvcanary report: {exc}", file=sys.stderr)
            return exit_env
        except OSError as exc:
            print(f"kvcanary report: cannot write {args.plot}: {exc}", file=sys.stderr)
            return exit_usage
    if args.json:
        print(json.dumps(as_json(summary, args.first)))
    else:
        print(render(summary, args.first))
        if args.plot:
            print(f"\ntimeline written to {args.plot}")
    return exit_ok if summary.clean else exit_failed
