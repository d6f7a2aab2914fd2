"""How the engine's step time varies from run to run, with the canary off and on (not run by CI).

The demo's share of step time is the median of alternating pairs of runs, and its pairs spread over tens of points
on one machine (dense at c7daeac: 3.5 % to 41.6 %, the canary's own timed work 4.9 %).  This runs the demo's clean
workload in alternating pairs, as ``kvcanary demo --baseline`` does, keeping every step's seconds (the step clock's
``durations``) and the seconds the garbage collector ran, so the spread can be taken apart: a whole run slower
(every step a little: the machine), or a few steps much slower (a collection, a stall), or the canary's steps.
With ``--pin N`` the same pairs run again with the process on N fixed CPUs (threads then stay on them).

Writes ``step_times_<model>.json`` (per run: side, pinned, steps' seconds, collector seconds) under ``--out`` and
prints each run's total, median and 90th-percentile step, and the pairs' shares by the run totals and by the steps'
medians.

Usage: PYTHONPATH=src python scripts/gpu/step_times.py [--model dense] [--pairs 6] [--pin 4] [--out DIR]
"""

from __future__ import annotations

import gc
import json
import os
import pathlib
import statistics
import time
from typing import Any

import probe_args
import torch

from kvcanary import demo
from kvcanary.adapters.transformers_cb import install
from kvcanary.adapters.transformers_cb.step_clock import StepClock
from kvcanary.config import CanaryConfig, Mode


class CollectorClock:
    """Seconds the garbage collector ran while entered (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start

    def __enter__(self) -> CollectorClock:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def one_run(model: Any, prompts: list[list[int]], opts: demo.DemoOptions, canary: bool) -> dict[str, Any]:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    with (
        install(model, CanaryConfig(mode=Mode.LOG if canary else Mode.OFF)),
        StepClock(keep=True) as clock,
        CollectorClock() as collector,
    ):
        demo.generate_waves(model, prompts, opts)
    return {"canary": canary, "steps": clock.durations, "gc_seconds": collector.seconds}


def line(run: dict[str, Any]) -> str:
    steps = sorted(run["steps"])
    p90 = steps[int(0.9 * (len(steps) - 1))]
    return (
        f"  {'on ' if run['canary'] else 'off'} total {sum(steps):.3f} s, {len(steps)} steps, median "
        f"{statistics.median(steps) * 1e3:.3f} ms, p90 {p90 * 1e3:.3f} ms, collector {run['gc_seconds']:.3f} s"
    )


def pairs_line(runs: list[dict[str, Any]]) -> str:
    off = [r for r in runs if not r["canary"]]
    on = [r for r in runs if r["canary"]]
    by_total = [max(sum(b["steps"]) - sum(a["steps"]), 0) / sum(b["steps"]) for a, b in zip(off, on, strict=True)]
    med = statistics.median
    by_median = [max(med(b["steps"]) - med(a["steps"]), 0) / med(b["steps"]) for a, b in zip(off, on, strict=True)]
    fmt = ", ".join
    return (
        f"  shares by run totals: {fmt(f'{s:.1%}' for s in by_total)} (median {med(by_total):.1%}); by the steps' "
        f"medians: {fmt(f'{s:.1%}' for s in by_median)} (median {med(by_median):.1%})"
    )


def main() -> None:
    p = probe_args.demo_parser(__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=6)
    p.add_argument("--pin", type=int, default=0, help="also run the pairs pinned to this many CPUs (0: not)")
    p.add_argument("--out", default=".")
    args = p.parse_args()
    opts = probe_args.options_of(args)
    model, prompts = demo.workload(opts)
    every = sorted(os.sched_getaffinity(0))
    settings = [("free", every)] + ([("pinned", every[-args.pin :])] if args.pin else [])
    kept: list[dict[str, Any]] = []
    with demo.quiet_engine_logs():
        for name, cpus in settings:
            os.sched_setaffinity(0, cpus)  # this thread; the engine's loop threads start from it and inherit it
            for side in (False, True):  # warm-up
                one_run(model, prompts, opts, side)
            runs = []
            for r in range(args.pairs):
                for side in (True, False) if r % 2 else (False, True):
                    runs.append(dict(one_run(model, prompts, opts, side), setting=name))
            print(f"model {args.model}, {name} (CPUs {cpus[0]}-{cpus[-1]}), {args.pairs} alternating pairs")
            for run in runs:
                print(line(run))
            print(pairs_line(runs), flush=True)
            kept += runs
    os.sched_setaffinity(0, every)
    out = pathlib.Path(args.out) / f"step_times_{args.model}.json"
    out.write_text(json.dumps(kept))


if __name__ == "__main__":
    main()
