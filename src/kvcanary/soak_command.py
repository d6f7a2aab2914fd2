"""The ``kvcanary soak`` subcommand: options, refusals and the exit code (the work is in :mod:`kvcanary.soak`)."""

from __future__ import annotations

import argparse

EPILOG = """exit codes:
  0  every phase silent (no violation, health failure or adapter error) and steady after warm-up
     (RSS growth <= 2 % + 16 MiB, median canary step time of the last 10 % of steps <= 1.5 x the first 10 %)
  1  the check failed (a violation, a health failure, an engine error, RSS or step time grew)
  2  bad command-line usage
  3  the environment cannot run it (engine missing or unsupported, no CUDA device, triton missing)
"""


HELP = "a long randomized clean workload on a real engine: silent, and steady in memory and step time"
DESCRIPTION = (
    "Requests arrive, finish and are cancelled continuously on the engine, with every feature it has (prefix "
    "reuse, forks, offload/restore, preemption, chunked prefill, sliding rings), the steps split between the "
    "engine's phases (models), until the canary ran --steps steps; then checks silence and steadiness (see exit "
    "codes)."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvcanary.cli_checks import add_device_options, add_output_options
    from kvcanary.soak import SOAK_ENGINES

    p.add_argument(
        "--engine", choices=tuple(SOAK_ENGINES), default="transformers", help="engine to run (default: transformers)"
    )
    p.add_argument("--steps", type=int, default=5000, help="canary steps in all (default: 5000)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload (default: 0)")
    phases = "; ".join(f"{name} {','.join(e.phases)}" for name, e in SOAK_ENGINES.items())
    p.add_argument(
        "--models", default=None,
        help=f"the phases, comma-separated (default: every phase of the engine: {phases})",
    )  # fmt: skip
    add_device_options(p)
    add_output_options(p)


def run(args: argparse.Namespace) -> int:
    from kvcanary.cli_checks import run_engine_command
    from kvcanary.ops import Backend
    from kvcanary.soak import SOAK_ENGINES, SoakOptions, run_soak, summary

    def options() -> SoakOptions:
        return SoakOptions(
            steps=args.steps, seed=args.seed, device=args.device, backend=Backend(args.backend),
            models=() if args.models is None else tuple(args.models.split(",")), engine=args.engine,
        )  # fmt: skip

    return run_engine_command(args, "soak", SOAK_ENGINES[args.engine].needs, options, run_soak, summary)
