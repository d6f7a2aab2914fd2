"""Does the step tap cost the engine less when it runs on another CPU core (not run by CI)?

The demo's share line leaves "the rest" unattributed: time the engine's own work takes longer with the canary on,
beyond the canary's timed work (about as much again as that work on the H100 at ed4be29).  An earlier probe
(launch_interference.py) found an engine step 86 us slower right after a few hundred microseconds of other Python
on its thread: the caches of its core left cold.  This runs the demo's clean workload with the canary off, and on
with its step tap run three ways, in rounds (the order rotating each round):
- ``inline``: on the engine's thread, as installed;
- ``thread``: handed to a worker thread and waited for (the engine's thread blocks, the GIL with it released);
- ``pinned``: the same, the worker and the engine's thread pinned to two different CPUs.
It prints each way's step time (median over the rounds) and what it adds over the canary off, and the tap's timed
host time.  Pure build only (it replaces a method of the tap's class).

Usage: PYTHONPATH=src python scripts/gpu/tap_thread_probe.py [--model hybrid] [--rounds 5]
"""

from __future__ import annotations

import contextlib
import os
import queue
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import probe_args
import torch

from kvcanary import demo
from kvcanary.adapters.transformers_cb import install
from kvcanary.adapters.transformers_cb.step_tap import StepTap
from kvcanary.config import CanaryConfig, Mode

WAYS = ("off", "inline", "thread", "pinned")


class TapWorker:
    """A thread that runs each call handed to it while the caller waits (one call at a time)."""

    def __init__(self, device: torch.device, cpu: int | None) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[[], None], queue.SimpleQueue[BaseException | None]]] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._serve, args=(device, cpu), daemon=True)
        self._thread.start()

    def _serve(self, device: torch.device, cpu: int | None) -> None:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})  # this thread only
        while True:
            call, done = self._calls.get()
            try:
                call()
                done.put(None)
            except BaseException as exc:  # handed back to the caller
                done.put(exc)

    def run(self, call: Callable[[], None]) -> None:
        done: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        self._calls.put((call, done))
        error = done.get()
        if error is not None:
            raise error


@contextlib.contextmanager
def tap_on_worker(device: torch.device, pin: tuple[int, int] | None) -> Iterator[None]:
    """``StepTap._tap`` run by a :class:`TapWorker`; with ``pin`` (engine CPU, worker CPU) both threads pinned."""
    original = StepTap._tap
    worker = TapWorker(device, None if pin is None else pin[1])
    pinned: set[int] = set()

    def tap(self: StepTap, runner: Any, batch_data: dict[str, Any]) -> None:
        if pin is not None and threading.get_ident() not in pinned:
            os.sched_setaffinity(0, {pin[0]})  # the engine's thread (one per run)
            pinned.add(threading.get_ident())
        worker.run(lambda: original(self, runner, batch_data))

    StepTap._tap = tap  # type: ignore[method-assign]
    try:
        yield
    finally:
        StepTap._tap = original  # type: ignore[method-assign]


def one_run(model: Any, prompts: list[list[int]], opts: demo.DemoOptions, way: str) -> tuple[float, float]:
    """Per step: the run's wall ms, and the tap's timed host ms (0 with the canary off)."""
    cpus = sorted(os.sched_getaffinity(0))
    pin = None
    if way == "pinned":  # two physical cores apart from CPU 0 where there are enough (siblings are often k, k + n/2)
        pin = (cpus[2], cpus[4]) if len(cpus) >= 6 else (cpus[0], cpus[-1])
    with contextlib.ExitStack() as stack:
        if way in ("thread", "pinned"):
            stack.enter_context(tap_on_worker(torch.device(opts.device), pin))
        c = stack.enter_context(install(model, CanaryConfig(mode=Mode.OFF if way == "off" else Mode.LOG)))
        start = time.perf_counter_ns()
        demo.generate_waves(model, prompts, opts)
        total = time.perf_counter_ns() - start
        stats = c.stats()
    steps = max(stats.get("taps", 0), 1)
    tap_us = sum(stats.get(k, 0) for k in ("tap_capture_us", "tap_translate_us", "tap_launch_us", "tap_host_step_us"))
    return total / 1e6 / steps, tap_us / 1000 / steps


def main() -> None:
    p = probe_args.demo_parser(__doc__.splitlines()[0], default_model="hybrid")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    opts = probe_args.options_of(args)
    model, prompts = demo.workload(opts)
    got: dict[str, list[tuple[float, float]]] = {w: [] for w in WAYS}
    affinity = os.sched_getaffinity(0)
    with demo.quiet_engine_logs():
        for way in WAYS:  # warm-up
            one_run(model, prompts, opts, way)
            os.sched_setaffinity(0, affinity)
        for r in range(args.rounds):
            for way in WAYS[r % len(WAYS) :] + WAYS[: r % len(WAYS)]:
                got[way].append(one_run(model, prompts, opts, way))
                os.sched_setaffinity(0, affinity)
    off = statistics.median(s for s, _ in got["off"])
    print(f"model {args.model}, {args.rounds} rounds, ms per step (median over the rounds)")
    print(f"{'way':<10}{'step':>9}{'added':>9}{'share':>8}{'tap':>8}  each round's step ms")
    for way in WAYS:
        step = statistics.median(s for s, _ in got[way])
        tap = statistics.median(t for _, t in got[way])
        rounds = ", ".join(f"{s:.3f}" for s, _ in got[way])
        print(f"{way:<10}{step:>9.3f}{step - off:>9.3f}{(step - off) / step:>8.1%}{tap:>8.3f}  {rounds}")


if __name__ == "__main__":
    main()
