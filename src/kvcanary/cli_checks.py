"""Shared subcommand setup (parser, device and output options), and refusals before any work starts:
combinations the machine or model cannot honour.

Each check answers with the documented exit code (2: usage, 3: environment) and a message naming the
problem and the way out, so a user never waits minutes for a run that could not do what was asked.
"""

from __future__ import annotations

import argparse
import importlib.util
import os

EXIT_USAGE = 2
EXIT_ENVIRONMENT = 3
# What every engine-running subcommand says when its engine is missing (the README's Install section).
INSTALL_HINT = "see the README's Install section: pip install -e '.[transformers]' after a CPU or CUDA torch"


def add_command(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, *, help: str, description: str, epilog: str
) -> argparse.ArgumentParser:
    """A subcommand of ``kvcanary``; its epilog (the exit codes) keeps its line breaks."""
    return sub.add_parser(
        name, help=help, description=description, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )


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


def demo_refusal(args: argparse.Namespace) -> tuple[int, str] | None:
    """``(exit code, message)`` when the demo's options cannot work here, else ``None``."""
    on_cuda = str(args.device).startswith("cuda")
    if not on_cuda and str(args.device) != "cpu":
        return EXIT_USAGE, f"--device must be cpu or cuda[:N], got {args.device!r}"
    if on_cuda and not _cuda_available():
        return EXIT_ENVIRONMENT, "--device cuda: torch sees no CUDA device here (run with --device cpu)"
    for flag, wanted in (("--async-batching", args.async_batching), ("--cuda-graphs", args.cuda_graphs)):
        if wanted and not on_cuda:
            return EXIT_USAGE, f"{flag} needs --device cuda (transformers runs it on CUDA only)"
    if args.backend == "triton":
        if importlib.util.find_spec("triton") is None:
            return EXIT_ENVIRONMENT, "--backend triton: triton is not installed (pip install 'kvcanary[triton]')"
        if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            return EXIT_USAGE, (
                "--backend triton on the CPU runs only under Triton's interpreter: set TRITON_INTERPRET=1, "
                "or use --backend reference"
            )
    return None
