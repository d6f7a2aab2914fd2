"""What every ``kvcanary`` subcommand shares: the exit codes, its parser (from its module's ``HELP``,
``DESCRIPTION``, ``EPILOG`` and ``add_arguments``), the device and output options, the refusals before any
work starts (combinations the machine or model cannot honour) and the frame of an engine-running command.

Each check answers with the documented exit code (2: usage, 3: environment) and a message naming the
problem and the way out, so a user never waits minutes for a run that could not do what was asked.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

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
# What every engine-running subcommand says when its engine is missing (the README's Install section).
INSTALL_HINT = "see the README's Install section: pip install -e '.[transformers]' after a CPU or CUDA torch"


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, command: ModuleType) -> None:
    """Subcommand ``name`` of ``kvcanary`` from its module: ``HELP``, ``DESCRIPTION``, ``EPILOG`` (the exit
    codes, line breaks kept) and ``add_arguments(parser)``."""
    parser = sub.add_parser(
        name,
        help=command.HELP,
        description=command.DESCRIPTION,
        epilog=command.EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    command.add_arguments(parser)


def fail(message: str, code: int) -> int:
    """``message`` on stderr; ``code``, the exit code to return."""
    print(message, file=sys.stderr)
    return code


def add_output_options(parser: argparse.ArgumentParser, progress: str = "progress lines") -> None:
    """``--json`` (only the JSON result on stdout) and ``--quiet`` (no ``progress`` on stderr)."""
    parser.add_argument("--json", action="store_true", help="print only the JSON result on stdout")
    parser.add_argument("--quiet", action="store_true", help=f"no {progress} on stderr")


def add_device_options(parser: argparse.ArgumentParser) -> None:
    """``--device`` and ``--backend``, as every engine-running subcommand takes them."""
    from kvcanary.ops import Backend

    parser.add_argument("--device", default="cpu", help="torch device for the model and the canary (default: cpu)")
    parser.add_argument(
        "--backend",
        choices=[b.value for b in Backend],
        default=Backend.AUTO.value,
        help="canary implementation: auto (kernels on CUDA, reference on CPU), reference or triton",
    )


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


# (flag, the argument it sets, the value it sets, why only CUDA has it)
_CUDA_ONLY = (
    ("--async-batching", "async_batching", True, "transformers runs it on CUDA only"),
    ("--cuda-graphs", "cuda_graphs", True, "transformers runs it on CUDA only"),
    ("--no-queue-moves", "queue_moves", False, "the queue rides the canary's step graph, on CUDA only"),
)


def refusal(args: argparse.Namespace) -> tuple[int, str] | None:
    """``(exit code, message)`` when an engine-running command's options cannot work here, else ``None``
    (``--async-batching``, ``--cuda-graphs`` and ``--no-queue-moves`` only where the command has them)."""
    on_cuda = str(args.device).startswith("cuda")
    if not on_cuda and str(args.device) != "cpu":
        return EXIT_USAGE, f"--device must be cpu or cuda[:N], got {args.device!r}"
    if on_cuda and not _cuda_available():
        return EXIT_ENVIRONMENT, "--device cuda: torch sees no CUDA device here (run with --device cpu)"
    for flag, dest, value, why in _CUDA_ONLY:
        if not on_cuda and getattr(args, dest, None) is value:
            return EXIT_USAGE, f"{flag} needs --device cuda ({why})"
    if args.backend == "triton":
        if importlib.util.find_spec("triton") is None:
            return EXIT_ENVIRONMENT, "--backend triton: triton is not installed (pip install 'kvcanary[triton]')"
        if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            return EXIT_USAGE, (
                "--backend triton on the CPU runs only under Triton's interpreter: set TRITON_INTERPRET=1, "
                "or use --backend reference"
            )
    return None


def run_engine_command(
    args: argparse.Namespace,
    prog: str,
    needs: str,
    options: Callable[[], Any],
    execute: Callable[..., Any],
    summary: Callable[[Any], str],
) -> int:
    """The frame of a command that runs an engine (the demo, the soak): refuse what cannot work here, build
    the ``options()`` (a ValueError is a usage error), ``execute(options, progress=...)`` (progress on stderr
    unless --quiet; an engine missing or unsupported is the environment's), print the result's JSON or
    ``summary`` and exit by whether it passed."""
    from kvcanary.adapters.base import UnsupportedEngineVersion

    refused = refusal(args)
    if refused is not None:
        return fail(f"kvcanary {prog}: {refused[1]}", refused[0])
    try:
        built = options()
    except ValueError as exc:
        return fail(f"kvcanary {prog}: {exc}", EXIT_USAGE)
    try:
        result = execute(built, progress=None if args.quiet else sys.stderr)
    except (ImportError, UnsupportedEngineVersion) as exc:
        hint = "" if "(" in needs else f" ({INSTALL_HINT})"  # a needs that names its own install keeps it
        return fail(f"kvcanary {prog} needs {needs}{hint}: {exc}", EXIT_ENVIRONMENT)
    print(json.dumps(result.as_json()) if args.json else summary(result))
    return EXIT_OK if result.passed else EXIT_CHECK_FAILED
