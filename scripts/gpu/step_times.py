"""How the engine's step time varies from run to run, with the canary off and on (not run by CI).

The demo's share of step time is the median of alternating pairs of runs, and its pairs spread over tens of points
on one machine (dense at c7daeac: 3.5 % to 41.6 %, the canary's own timed work 4.9 %).  This runs the demo's clean
workload in alternating pairs, as ``kvcanary demo --baseline`` does, keeping every step's seconds (the step clock's
``durations``) and the seconds the garbage collector ran, so the spread can be taken apart: a whole run slower
(every step a little: the machine), or a few steps much slower (a collection, a stall), or the canary's steps.
With ``--pin N`` the same pairs run again with the process on N fixed CPUs (threads then stay on them).

Writes ``step_times_<model>.json`` (per run: side, setting, steps' microseconds, collector seconds) under ``--out`` and
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


SIDES = {"off": Mode.OFF, "on": Mode.LOG}


def one_run(model: Any, prompts: list[list[int]], opts: demo.DemoOptions, side: str) -> dict[str, Any]:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    mode = SIDES[side]
    with (
        install(model, CanaryConfig(mode=mode)) as canary,
        StepClock(keep=True) as clock,
        CollectorClock() as collector,
    ):
        demo.generate_waves(model, prompts, opts)
    stats = canary.stats() if mode is Mode.LOG else {}
    tap = stats.get("tap_us", 0) / max(len(clock.durations or ()), 1)
    failed = stats.get("violations", 0) + stats.get("health_failures", 0) + stats.get("adapter_errors", 0)
    if failed:  # every canary run is a clean run, as in the demo
        raise SystemExit(f"a clean {side} run reported {failed} violations, health failures or adapter errors: {stats}")
    return {"side": side, "canary": mode is Mode.LOG, "steps": clock.durations, "gc_seconds": collector.seconds,
            "tap_us": tap, "verified": stats.get("verified_slots", 0)}  # fmt: skip


def line(run: dict[str, Any]) -> str:
    steps = sorted(run["steps"])
    p90 = steps[int(0.9 * (len(steps) - 1))]
    return (
        f"  {run['side']:6} total {sum(steps):.3f} s, {len(steps)} steps, median "
        f"{statistics.median(steps) * 1e3:.3f} ms, p90 {p90 * 1e3:.3f} ms, collector {run['gc_seconds']:.3f} s, "
        f"tap {run['tap_us']:.0f} us a step, {run['verified']:,} slots verified"
    )


def pairs_line(runs: list[dict[str, Any]], side: str = "on") -> str:
    off = [r for r in runs if r["side"] == "off"]
    on = [r for r in runs if r["side"] == side]
    by_total = [max(sum(b["steps"]) - sum(a["steps"]), 0) / sum(b["steps"]) for a, b in zip(off, on, strict=True)]
    med = statistics.median
    by_median = [max(med(b["steps"]) - med(a["steps"]), 0) / med(b["steps"]) for a, b in zip(off, on, strict=True)]
    fmt = ", ".join
    return (
        f"  {side}: shares by run totals: {fmt(f'{s:.1%}' for s in by_total)} (median {med(by_total):.1%}); "
        f"by the steps' medians: {fmt(f'{s:.1%}' for s in by_median)} (median {med(by_median):.1%})"
    )


def by_step_line(runs: list[dict[str, Any]], side: str = "on", first: int = 3) -> str:
    """Each step's median over the runs of a side, compared step by step (the workload is the same every run): what
    the first ``first`` steps added, and the mean and median added a step over the rest."""
    med = statistics.median
    on = [r["steps"] for r in runs if r["side"] == side]
    off = [r["steps"] for r in runs if r["side"] == "off"]
    n = min(map(len, on + off))
    added = [(med(r[i] for r in on) - med(r[i] for r in off)) * 1e3 for i in range(n)]
    head = ", ".join(f"{a:.2f}" for a in added[:first])
    rest = added[first:]
    return (
        f"  {side}: step by step (medians over the runs): the first {first} steps added {head} ms; the other "
        f"{len(rest)} added {statistics.fmean(rest):.3f} ms a step (median {med(rest):.3f})"
    )


def main() -> None:
    p = probe_args.demo_parser(__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=6)
    p.add_argument("--pin", type=int, default=0, help="also run the rounds pinned to this many CPUs (0: not)")
    p.add_argument("--out", default=".")
    args = p.parse_args()
    sides = list(SIDES)
    opts = probe_args.options_of(args)
    model, prompts = demo.workload(opts)
    every = sorted(os.sched_getaffinity(0))
    settings = [("free", every)] + ([("pinned", every[-args.pin :])] if args.pin else [])
    kept: list[dict[str, Any]] = []
    with demo.quiet_engine_logs():
        for name, cpus in settings:
            os.sched_setaffinity(0, cpus)  # this thread; the engine's loop threads start from it and inherit it
            for side in sides:  # warm-up
                one_run(model, prompts, opts, side)
            runs = []
            for r in range(args.pairs):
                order = sides[r % len(sides) :] + sides[: r % len(sides)]
                runs += [dict(one_run(model, prompts, opts, side), setting=name) for side in order]
            print(f"model {args.model}, {name} (CPUs {cpus[0]}-{cpus[-1]}), {args.pairs} alternating pairs")
            for run in runs:
                print(line(run))
            for side in sides[1:]:
                print(pairs_line(runs, side))
                print(by_step_line(runs, side), flush=True)
            kept += runs
    os.sched_setaffinity(0, every)
    for run in kept:  # whole microseconds: the file is kept with the results
        run["steps"] = [round(t * 1e6) for t in run["steps"]]
        run["unit"] = "us"
    out = pathlib.Path(args.out) / f"step_times_{args.model}.json"
    out.write_text(json.dumps(kept, separators=(",", ":")))


if __name__ == "__main__":
    main()
