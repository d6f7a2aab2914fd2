"""``kvcanary selftest``: argument parsing, the engine choice, the progress bar and the output."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

DEFAULT_TRIALS = 20

EPILOG = """exit codes:
  0  every 'detect' fault was caught in every trial (within one step of its first affected read)
     and the clean controls raised no violation
  1  a 'detect' fault was missed or caught late in some trial, a control raised a violation, or a run failed
  2  bad command-line usage (unknown engine or fault, trials < 1, ...)
  3  the environment cannot run it (the engine or its self-test missing here, an unsupported engine version,
     --plot without matplotlib)
"""


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


HELP = "inject the fault library into a real engine and print the detection matrix"
DESCRIPTION = (
    "Runs every fault of the library (or the ones named) on a real engine with the canary on, "
    "each in N randomized trials (random workload, fault injected at a random eligible step), plus clean "
    "controls with the same seeds, and prints which faults were caught, by which check and how fast. "
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvcanary.cli_checks import add_output_options
    from kvcanary.selftest.registry import DEFAULT_ENGINE, ENGINES

    p.description = DESCRIPTION + _default_faults(DEFAULT_ENGINE)
    p.add_argument(
        "--engine",
        choices=list(ENGINES),
        default=DEFAULT_ENGINE,
        help=f"engine to run (default: {DEFAULT_ENGINE}); each engine has its own fault library",
    )
    p.add_argument(
        "--faults",
        nargs="+",
        metavar="FAULT",
        help="faults to run, space- or comma-separated (default: all)",
    )
    p.add_argument(
        "--trials", type=_positive, default=DEFAULT_TRIALS, help=f"trials per fault (default: {DEFAULT_TRIALS})"
    )
    p.add_argument("--seed", type=int, default=0, help="base seed of the workloads and injections (default: 0)")
    add_output_options(p, progress="progress bar")
    p.add_argument("--list", action="store_true", help="list the faults (bug class, expectation) and exit")
    p.add_argument("--plot", metavar="FILE.png", help="also draw the detection matrix into FILE.png (needs matplotlib)")


def _default_faults(engine: str) -> str:
    from kvcanary.selftest.protocol import EngineUnavailable
    from kvcanary.selftest.registry import load_driver

    try:
        return f"Faults ({engine}): " + ", ".join(load_driver(engine).faults) + "."
    except EngineUnavailable:
        return ""


def fault_names(values: list[str] | None, faults: Mapping[str, Any]) -> list[str] | None:
    """``--faults a b,c`` -> ["a", "b", "c"]; raises ValueError naming faults not in ``faults``."""
    if not values:
        return None
    names = [n.strip() for v in values for n in v.split(",") if n.strip()]
    unknown = [n for n in names if n not in faults]
    if unknown or not names:
        raise ValueError(f"unknown fault(s): {', '.join(unknown) or '(none given)'}; choose from: {', '.join(faults)}")
    return list(dict.fromkeys(names))


def fault_list(faults: Mapping[str, Any]) -> str:
    """``--list``: one aligned row per fault (name, expectation, the check expected to fire, bug class)."""
    rows = [("fault", "expect", "check", "bug class")]
    rows += [(name, cls.spec.expected.value, cls.spec.check, cls.spec.bug_class) for name, cls in faults.items()]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join("  ".join(r[i].ljust(widths[i]) for i in range(3)) + "  " + r[3] for r in rows)


class ProgressBar:
    """A one-line bar on a terminal; on a log (not a TTY), a line every tenth of the way."""

    def __init__(self, stream: TextIO, width: int = 30) -> None:
        self.stream = stream
        self.width = width
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.start = time.perf_counter()
        self._last_decile = -1

    def __call__(self, done: int, total: int, label: str) -> None:
        frac = done / total if total else 1.0
        elapsed = time.perf_counter() - self.start
        if self.tty:
            n = int(frac * self.width)
            bar = "#" * n + "-" * (self.width - n)
            text = f"\rselftest [{bar}] {done}/{total} runs {elapsed:4.0f}s  {label[:48]:<48}"
            self.stream.write(text)
            if label == "done":
                self.stream.write("\n")
        elif int(frac * 10) > self._last_decile or label == "done":
            self._last_decile = int(frac * 10)
            self.stream.write(f"selftest: {done}/{total} runs ({frac:.0%}, {elapsed:.0f} s) {label}\n")
        self.stream.flush()


def run(args: argparse.Namespace) -> int:
    from kvcanary.cli_checks import EXIT_CHECK_FAILED, EXIT_ENVIRONMENT, EXIT_OK, EXIT_USAGE, INSTALL_HINT, fail
    from kvcanary.selftest.protocol import EngineUnavailable
    from kvcanary.selftest.registry import load_driver

    try:
        driver = load_driver(args.engine)
    except EngineUnavailable as exc:
        return fail(f"kvcanary selftest --engine {args.engine}: {exc}", EXIT_ENVIRONMENT)
    if args.list:
        print(fault_list(driver.faults))
        return EXIT_OK
    try:
        names = fault_names(args.faults, driver.faults)
    except ValueError as exc:
        return fail(f"kvcanary selftest: {exc}", EXIT_USAGE)
    if args.plot:  # refuse before the runs, not after minutes of them
        from kvcanary.plots import PlotsUnavailable, require_matplotlib

        try:
            require_matplotlib()
        except PlotsUnavailable as exc:
            return fail(f"kvcanary selftest: {exc}", EXIT_ENVIRONMENT)
    try:
        from kvcanary.selftest.report import as_json, table
        from kvcanary.selftest.runner import run_selftest

        progress = None if args.quiet else ProgressBar(sys.stderr)
        result = run_selftest(driver, names, trials=args.trials, seed=args.seed, progress=progress)
    except (ImportError, EngineUnavailable) as exc:
        return fail(
            f"kvcanary selftest --engine {args.engine} cannot run here ({INSTALL_HINT}): {exc}", EXIT_ENVIRONMENT
        )
    print(json.dumps(as_json(result, args.seed)) if args.json else table(result, args.seed))
    if args.plot and not _plot(result, args.plot):
        return EXIT_USAGE
    return EXIT_OK if result.passed else EXIT_CHECK_FAILED


def _plot(result: Any, path: str) -> bool:
    from kvcanary.plots import selftest_matrix

    try:
        selftest_matrix(result, path)
    except OSError as exc:
        print(f"kvcanary selftest: cannot write {path}: {exc}", file=sys.stderr)
        return False
    print(f"kvcanary selftest: detection matrix drawn into {path}", file=sys.stderr)
    return True
