"""How the engine's step time varies from run to run, with the canary off and on (not run by CI).

The demo's share of step time is the median of alternating pairs of runs, and its pairs spread over tens of points
on one machine (dense at c7daeac: 3.5 % to 41.6 %, the canary's own timed work 4.9 %).  This runs the demo's clean
workload in alternating pairs, as ``kvcanary demo --baseline`` does, keeping every step's seconds (the step clock's
``durations``) and the seconds the garbage collector ran, so the spread can be taken apart: a whole run slower
(every step a little: the machine), or a few steps much slower (a collection, a stall), or the canary's steps.
With ``--pin N`` the same pairs run again with the process on N fixed CPUs (threads then stay on them).

``--spin-us N`` times a stand-in instead of the canary: the canary off, and the engine's thread spinning N
microseconds where the step tap runs (after ``ModelRunner.compute_batch``), touching no memory.  Its share says how
much step time a given host delay at that point costs; a canary of the same host time that adds more adds it
through what it touches (caches, allocations) or its device work, not its own clock.

Writes ``step_times_<model>.json`` (per run: side, setting, steps' microseconds, collector seconds) under ``--out`` and
prints each run's total, median and 90th-percentile step, the pairs' shares by the run totals and by the steps'
medians, and the demo's step-by-step comparison.

Usage: PYTHONPATH=src python scripts/gpu/step_times.py [--model dense] [--pairs 6] [--pin 4] [--spin-us 130]
       [--out DIR]
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import pathlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import probe_args
import torch

from kvcanary import demo
from kvcanary.adapters.patching import PatchSet
from kvcanary.adapters.transformers_cb import install
from kvcanary.adapters.transformers_cb.step_clock import StepClock
from kvcanary.config import CanaryConfig, Mode
from kvcanary.demo_timing import ShareTiming, step_by_step_line, time_share

_RUNNER = "transformers.generation.continuous_batching.model_runner"


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


@contextlib.contextmanager
def spinning(us: int) -> Iterator[None]:
    """``ModelRunner.compute_batch`` followed by ``us`` microseconds of spinning (none for 0)."""
    patches = PatchSet(exclusive=False)  # under the canary's own wrapper, as its tap would run

    def spin_after(original: Callable[..., Any]) -> Callable[..., Any]:
        def compute_batch(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            end = time.perf_counter_ns() + us * 1000
            while time.perf_counter_ns() < end:
                pass
            return out

        return compute_batch

    if us:
        patches.wrap(importlib.import_module(_RUNNER).ModelRunner, "compute_batch", spin_after)
    try:
        yield
    finally:
        patches.restore()


def one_run(
    model: Any, prompts: list[list[int]], opts: demo.DemoOptions, canary: bool, spin_us: int = 0
) -> dict[str, Any]:
    """One timed run: the canary off, or on (``canary``), or off with the spinning stand-in where ``spin_us``."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    spin_us, canary = (spin_us, False) if canary and spin_us else (0, canary)  # the stand-in takes the canary's side
    with (
        spinning(spin_us),
        install(model, CanaryConfig(mode=Mode.LOG if canary else Mode.OFF)) as handle,
        StepClock(keep=True) as clock,
        CollectorClock() as collector,
    ):
        demo.generate_waves(model, prompts, opts)
    stats = handle.stats() if canary else {}
    tap = stats.get("tap_us", 0) / max(len(clock.durations or ()), 1)
    failed = stats.get("violations", 0) + stats.get("health_failures", 0) + stats.get("adapter_errors", 0)
    if failed:  # every canary run is a clean run, as in the demo
        raise SystemExit(f"a clean canary run reported {failed} violations, health failures or adapter errors: {stats}")
    side = "on" if canary else "spin" if spin_us else "off"
    return {"side": side, "canary": side != "off", "steps": clock.durations, "cpu_seconds": clock.cpu_seconds,
            "gc_seconds": collector.seconds, "tap_us": tap, "verified": stats.get("verified_slots", 0)}  # fmt: skip


def line(run: dict[str, Any]) -> str:
    steps = sorted(run["steps"])
    p90 = steps[int(0.9 * (len(steps) - 1))]
    return (
        f"  {run['side']:3} total {sum(steps):.3f} s, {len(steps)} steps, median "
        f"{statistics.median(steps) * 1e3:.3f} ms, p90 {p90 * 1e3:.3f} ms, CPU {run['cpu_seconds']:.3f} s, "
        f"collector {run['gc_seconds']:.3f} s, "
        f"tap {run['tap_us']:.0f} us a step, {run['verified']:,} slots verified"
    )


def pairs_lines(off: list[dict[str, Any]], on: list[dict[str, Any]]) -> list[str]:
    """The pairs' shares by run totals (the demo's, :class:`~kvcanary.demo_timing.ShareTiming`) and by the steps'
    medians, then the demo's step-by-step line (:func:`~kvcanary.demo_timing.step_by_step_line`)."""
    steps = (tuple(tuple(r["steps"]) for r in off), tuple(tuple(r["steps"]) for r in on))
    cpus = (tuple(r["cpu_seconds"] for r in off), tuple(r["cpu_seconds"] for r in on))
    timing = ShareTiming(tuple(map(sum, steps[0])), tuple(map(sum, steps[1])), steps=steps, cpus=cpus)
    med = statistics.median
    by_median = [max(med(b) - med(a), 0) / med(b) for a, b in zip(*steps, strict=True)]
    fmt = ", ".join
    shares = (
        f"  shares by run totals: {fmt(f'{s:.1%}' for s in timing.shares)} (median {timing.share:.1%}); "
        f"by the steps' medians: {fmt(f'{s:.1%}' for s in by_median)} (median {med(by_median):.1%}); "
        f"by the loop thread's CPU time: {fmt(f'{s:.1%}' for s in timing.cpu_shares or ())} "
        f"(median {med(timing.cpu_shares or [0.0]):.1%})"
    )
    return [shares] + [by_step for by_step in (step_by_step_line(timing),) if by_step is not None]


def alternating(
    model: Any, prompts: list[list[int]], opts: demo.DemoOptions, pairs: int, spin_us: int = 0
) -> list[dict[str, Any]]:
    """A warm-up run of each side, then ``pairs`` pairs in the demo's alternating order (:func:`time_share`); the
    canary's side is the spinning stand-in where ``spin_us``."""
    for canary in (False, True):
        one_run(model, prompts, opts, canary, spin_us)
    runs: list[dict[str, Any]] = []

    def run(canary: bool) -> float:
        runs.append(one_run(model, prompts, opts, canary, spin_us))
        return float(sum(runs[-1]["steps"]))

    time_share(lambda _: (run(True), 0), lambda: run(False), pairs)
    return runs


def main() -> None:
    p = probe_args.demo_parser(__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=6)
    p.add_argument("--pin", type=int, default=0, help="also run the pairs pinned to this many CPUs (0: not)")
    p.add_argument("--spin-us", type=int, default=0, help="time a stand-in spinning this long a step, not the canary")
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
            runs = [dict(r, setting=name) for r in alternating(model, prompts, opts, args.pairs, args.spin_us)]
            against = f"against a {args.spin_us} us spin" if args.spin_us else "canary off and on"
            print(f"model {args.model}, {name} (CPUs {cpus[0]}-{cpus[-1]}), {args.pairs} alternating pairs, {against}")
            for r in runs:
                print(line(r))
            off, on = [r for r in runs if not r["canary"]], [r for r in runs if r["canary"]]
            print("\n".join(pairs_lines(off, on)), flush=True)
            kept += runs
    os.sched_setaffinity(0, every)
    for r in kept:  # whole microseconds: the file is kept with the results
        r["steps"] = [round(t * 1e6) for t in r["steps"]]
        r["unit"] = "us"
    spin = f"_spin{args.spin_us}" if args.spin_us else ""
    out = pathlib.Path(args.out) / f"step_times_{args.model}{spin}.json"
    out.write_text(json.dumps(kept, separators=(",", ":")))


if __name__ == "__main__":
    main()
