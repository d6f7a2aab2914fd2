"""``kvcanary demo``: options and the exit code (the work is in :mod:`kvcanary.demo`)."""

from __future__ import annotations

import argparse

from kvcanary.cli_checks import EXIT_CODES

HELP = "run the canary on transformers continuous batching: a clean run, then one with an injected fault"
DESCRIPTION = (
    "Builds a tiny random-weight model (no download), runs 64+ requests through transformers' "
    "generate_batch with the canary on, then reruns with one fault of the self-test's library injected."
)
EPILOG = EXIT_CODES


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvcanary.adapters.transformers_cb.selftest import FAULTS
    from kvcanary.adapters.transformers_cb.selftest.workload import MODEL_KINDS
    from kvcanary.cli_checks import add_device_options, add_output_options
    from kvcanary.demo import DEFAULT_FAULTS
    from kvcanary.demo_timing import ROUNDS

    p.add_argument("--model", choices=MODEL_KINDS, default="dense", help="model kind (default: dense)")
    p.add_argument(
        "--fault",
        choices=list(FAULTS),
        default=None,
        metavar="FAULT",
        help="fault to inject, one of `kvcanary selftest --list` (default by model: "
        + ", ".join(f"{model} {fault}" for model, fault in DEFAULT_FAULTS.items())
        + ")",
    )
    p.add_argument("--requests", type=int, default=64, help="number of prompts (default: 64)")
    add_device_options(p)
    p.add_argument("--async-batching", action="store_true", help="the engine's asynchronous batching (CUDA)")
    p.add_argument("--cuda-graphs", action="store_true", help="the engine's CUDA graphs (CUDA)")
    p.add_argument(
        "--baseline",
        action="store_true",
        help="also time the workload with the canary off: alternating pairs of timed runs, the share their median",
    )
    p.add_argument(
        "--rounds", type=int, default=ROUNDS, metavar="N",
        help=f"with --baseline: pairs of timed runs (default: {ROUNDS}); more steady the share where runs vary",
    )  # fmt: skip
    p.add_argument(
        "--digest", type=float, default=None, metavar="BUDGET",
        help="also check the K/V bytes with the KV digest, re-verifying this share of each step's reads (0-1]",
    )  # fmt: skip
    p.add_argument(
        "--no-queue-moves", dest="queue_moves", action="store_false",
        help="mirror each of the engine's block moves at once instead of queueing it for the step's device work (CUDA)",
    )  # fmt: skip
    add_output_options(p)


def run(args: argparse.Namespace) -> int:
    from kvcanary.cli_checks import run_engine_command
    from kvcanary.demo import DemoOptions, run_demo
    from kvcanary.demo_summary import summary
    from kvcanary.ops import Backend

    def options() -> DemoOptions:
        return DemoOptions(
            model=args.model,
            fault=args.fault,
            requests=args.requests,
            device=args.device,
            backend=Backend(args.backend),
            baseline=args.baseline,
            rounds=args.rounds,
            async_batching=args.async_batching,
            cuda_graphs=args.cuda_graphs,
            digest_budget=args.digest,
            queue_moves=args.queue_moves,
        )

    return run_engine_command(args, "demo", "transformers 5.24.0", options, run_demo, summary)
