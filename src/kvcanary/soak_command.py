"""The ``kvcanary soak`` subcommand: options, refusals and the exit code (the work is in :mod:`kvcanary.soak`)."""

from __future__ import annotations

import argparse

ENGINES = ("transformers",)
EPILOG = """exit codes:
  0  every phase silent (no violation, health failure or adapter error) and steady after warm-up
     (RSS growth <= 2 % + 16 MiB, median canary step time of the last 10 % of steps <= 1.5 x the first 10 %)
  1  the check failed (a violation, a health failure, an engine error, RSS or step time grew)
  2  bad command-line usage
  3  the environment cannot run it (engine missing or unsupported, no CUDA device, triton missing)
"""


HELP = "a long randomized clean workload on a real engine: silent, and steady in memory and step time"
DESCRIPTION = (
    "Requests arrive, finish and are cancelled continuously on the engine (prefix reuse, forks, "
    "CPU offload/restore, chunked prefill, sliding rings), the steps split between a dense and a hybrid "
    "model, until the canary ran --steps steps; then checks silence and steadiness (see exit codes)."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvcanary.cli_checks import add_device_options, add_output_options

    p.add_argument("--engine", choices=ENGINES, default=ENGINES[0], help="engine to run (default: transformers)")
    p.add_argument("--steps", type=int, default=5000, help="canary steps in all (default: 5000)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload (default: 0)")
    p.add_argument(
        "--models", default="dense,hybrid",
        help="the phases, comma-separated (default: dense,hybrid); one model per process lets a many-core host run "
        "the phases side by side",
    )  # fmt: skip
    add_device_options(p)
    add_output_options(p)


def run(args: argparse.Namespace) -> int:
    from kvcanary.cli_checks import EXIT_ENVIRONMENT, fail, run_engine_command
    from kvcanary.ops import Backend

    try:
        from kvcanary.soak import SoakOptions, run_soak, summary
    except ImportError as exc:  # psutil (the RSS readings) is missing
        return fail(f"kvcanary soak: {exc}", EXIT_ENVIRONMENT)

    def options() -> SoakOptions:
        return SoakOptions(
            steps=args.steps, seed=args.seed, device=args.device, backend=Backend(args.backend),
            models=tuple(args.models.split(",")),
        )  # fmt: skip

    return run_engine_command(args, "soak", "transformers 5.24.0 and psutil", options, run_soak, summary)
