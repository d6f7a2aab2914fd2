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
import json
import os
import sys
from collections.abc import Sequence

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2
EXIT_ENVIRONMENT = 3

EXIT_CODES = """exit codes:
  0  success (demo: the clean run raised no violation and the injected fault was caught;
     selftest: every 'detect' fault caught in every trial and the clean controls silent)
  1  the check failed (a violation in a clean run, a fault missed or caught late, a run failed;
     report: the event log records violations or failed health checks)
  2  bad command-line usage (unknown option or value, an option combination that cannot work,
     report: the file is missing or not an event log of schema version 1)
  3  the environment cannot run it (engine missing or unsupported, no CUDA device, triton missing,
     --plot without matplotlib)
"""


def _parser() -> argparse.ArgumentParser:
    from kvcanary import __version__, report_command
    from kvcanary.adapters.transformers_cb.selftest import FAULTS
    from kvcanary.adapters.transformers_cb.selftest.workload import MODEL_KINDS
    from kvcanary.cli_checks import add_command, add_device_options, add_output_options
    from kvcanary.demo import DEFAULT_FAULTS
    from kvcanary.selftest import command as selftest
    from kvcanary.soak_command import add_parser as add_soak_parser

    parser = argparse.ArgumentParser(
        prog="kvcanary",
        description="Run-time detection of silent KV-cache corruption.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvcanary {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = add_command(
        sub,
        "demo",
        help="run the canary on transformers continuous batching: a clean run, then one with an injected fault",
        description="Builds a tiny random-weight model (no download), runs 64+ requests through transformers' "
        "generate_batch with the canary on, then reruns with one fault of the self-test's library injected.",
        epilog=EXIT_CODES,
    )
    demo.add_argument("--model", choices=MODEL_KINDS, default="dense", help="model kind (default: dense)")
    demo.add_argument(
        "--fault",
        choices=list(FAULTS),
        default=None,
        metavar="FAULT",
        help="fault to inject, one of `kvcanary selftest --list` (default by model: "
        + ", ".join(f"{model} {fault}" for model, fault in DEFAULT_FAULTS.items())
        + ")",
    )
    demo.add_argument("--requests", type=int, default=64, help="number of prompts (default: 64)")
    add_device_options(demo)
    demo.add_argument("--async-batching", action="store_true", help="the engine's asynchronous batching (CUDA)")
    demo.add_argument("--cuda-graphs", action="store_true", help="the engine's CUDA graphs (CUDA)")
    demo.add_argument("--baseline", action="store_true", help="also time the workload without the canary")
    demo.add_argument(
        "--digest", type=float, default=None, metavar="BUDGET",
        help="also check the K/V bytes with the KV digest, re-verifying this share of each step's reads (0-1]",
    )  # fmt: skip
    add_output_options(demo)
    selftest.add_parser(sub)
    add_soak_parser(sub)
    report_command.add_parser(sub)
    return parser


def _demo(args: argparse.Namespace) -> int:
    from kvcanary.adapters.base import UnsupportedEngineVersion
    from kvcanary.cli_checks import INSTALL_HINT, demo_refusal
    from kvcanary.demo import DemoOptions, run_demo, summary
    from kvcanary.ops import Backend

    refusal = demo_refusal(args)
    if refusal is not None:
        print(f"kvcanary demo: {refusal[1]}", file=sys.stderr)
        return refusal[0]
    try:
        options = DemoOptions(
            model=args.model,
            fault=args.fault,
            requests=args.requests,
            device=args.device,
            backend=Backend(args.backend),
            baseline=args.baseline,
            async_batching=args.async_batching,
            cuda_graphs=args.cuda_graphs,
            digest_budget=args.digest,
        )
    except ValueError as exc:
        print(f"kvcanary demo: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        result = run_demo(options, progress=None if args.quiet else sys.stderr)
    except (ImportError, UnsupportedEngineVersion) as exc:
        print(f"kvcanary demo needs transformers 5.24.0 ({INSTALL_HINT}): {exc}", file=sys.stderr)
        return EXIT_ENVIRONMENT
    if args.json:
        print(json.dumps(result.as_json()))
    else:
        print(summary(result))
    return EXIT_OK if result.passed else EXIT_CHECK_FAILED


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
    if args.command == "demo":
        return _demo(args)
    if args.command == "selftest":
        from kvcanary.selftest import command

        return command.run(args, EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE, EXIT_ENVIRONMENT)
    if args.command == "report":
        from kvcanary import report_command

        return report_command.run(args, EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE, EXIT_ENVIRONMENT)
    if args.command == "soak":
        from kvcanary import soak_command

        return soak_command.run(args, EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE, EXIT_ENVIRONMENT)
    parser.error(f"unknown command {args.command!r}")
    return EXIT_USAGE  # not reached: parser.error exits


if __name__ == "__main__":
    sys.exit(main())
