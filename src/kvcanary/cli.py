"""The ``kvcanary`` command line.

Subcommands: ``demo`` (the canary on transformers continuous batching, a clean run and a faulted run),
``selftest`` (the fault library injected into a real engine in randomized trials: the detection matrix),
``report`` (a summary of the runtime's JSON-lines event log) and ``soak`` (a long randomized clean workload:
silent, and steady in memory and step time; :mod:`kvcanary.soak`).

Exit codes:

* 0 -- success (``demo``: the clean run raised no violation and the injected fault was caught;
  ``selftest``: every 'detect' fault caught in every trial and the clean controls silent);
* 1 -- the check failed (``demo``: a violation in the clean run, or the fault went unnoticed;
  ``selftest``: a 'detect' fault missed or caught late, a control raised a violation, or a run failed);
* 2 -- bad command-line usage;
* 3 -- the environment cannot run the command (an engine missing or of an unsupported version, no CUDA
  device for ``--device cuda``, ...).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from kvcanary.cli_checks import EXIT_CHECK_FAILED, EXIT_CODES, EXIT_ENVIRONMENT, add_command
from kvcanary.cli_checks import EXIT_OK as EXIT_OK  # the exit codes, for callers of main()
from kvcanary.cli_checks import EXIT_USAGE as EXIT_USAGE

# Each subcommand's module: HELP, DESCRIPTION, EPILOG, add_arguments(parser) and run(args) -> exit code.
SUBCOMMANDS = {
    "demo": "kvcanary.demo_command",
    "selftest": "kvcanary.selftest.command",
    "soak": "kvcanary.soak_command",
    "report": "kvcanary.report_command",
}


def _parser() -> argparse.ArgumentParser:
    from kvcanary import __version__

    parser = argparse.ArgumentParser(
        prog="kvcanary",
        description="Run-time detection of silent KV-cache corruption.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvcanary {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in SUBCOMMANDS.items():
        add_command(sub, name, importlib.import_module(module))
    return parser


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            found: argparse.ArgumentParser = action.choices[name]
            return found
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # `kvcanary report ... | head`: the reader left; say nothing more
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 -- Python flushes stdout at exit: keep it quiet
        return EXIT_CHECK_FAILED


def _main(argv: Sequence[str] | None) -> int:
    try:
        parser = _parser()
    except ImportError as exc:  # the demo's choices come from kvcanary modules that import torch
        print(f"kvcanary: {exc}", file=sys.stderr)
        return EXIT_ENVIRONMENT
    args, extra = parser.parse_known_args(argv)
    if extra:  # name the subcommand's own usage, not the top level's
        sub = _subparser(parser, args.command)
        sub.error(f"unrecognized arguments: {' '.join(extra)}")
    code: int = importlib.import_module(SUBCOMMANDS[args.command]).run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
