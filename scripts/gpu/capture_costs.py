"""What capturing one of the canary's step graphs costs the host, piece by piece, with the GPU idle and with it
still running earlier work (as the engine's forward is when a step is captured).  A piece that costs milliseconds
only when the GPU is busy waits for the device.  The work captured is a handful of small kernels (the canary's
step graph has four to eight nodes).  Not run by CI.  Usage: PYTHONPATH=src python scripts/gpu/capture_costs.py"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable

import torch

from kvcanary.runtime.cuda_calls import CudaCalls
from kvcanary.runtime.step_graphs import CudaStepGraph

KERNELS = 6
ROUNDS = 20
BUSY_CYCLES = 20_000_000  # about 10 ms of a spinning kernel queued ahead of the capture


def pieces(
    work: Callable[[], None], pool: object, calls: CudaCalls, busy: bool, kept: list[object]
) -> dict[str, float]:
    """One capture, as :class:`CudaStepGraph` makes it, timed piece by piece (microseconds); the graph joins ``kept``:
    torch refuses to capture into a pool whose graphs were all freed."""
    torch.cuda.synchronize()
    if busy:
        torch.cuda._sleep(BUSY_CYCLES)
    marks = [time.perf_counter_ns()]
    graph = torch.cuda.CUDAGraph()
    current = torch.cuda.current_stream()
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(current)
    marks.append(time.perf_counter_ns())
    with torch.cuda.stream(side):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        marks.append(time.perf_counter_ns())
        work()
        marks.append(time.perf_counter_ns())
        graph.capture_end()
        marks.append(time.perf_counter_ns())
    current.wait_stream(side)
    kept.append(graph)
    launch = calls.graph_launch(graph)
    marks.append(time.perf_counter_ns())
    launch()
    marks.append(time.perf_counter_ns())
    launch()
    marks.append(time.perf_counter_ns())
    names = ("graph and side stream", "capture_begin", "work", "capture_end", "launch bound", "first launch",
             "second launch")  # fmt: skip
    return {n: (b - a) / 1000 for n, (a, b) in zip(names, itertools.pairwise(marks), strict=True)}


def main() -> None:
    x = torch.zeros(1 << 16, device="cuda")

    def work() -> None:
        for _ in range(KERNELS):
            x.add_(1)

    pool = torch.cuda.graph_pool_handle()
    calls = CudaCalls(torch.cuda.current_device())
    kept: list[object] = []  # every graph of the pool, alive to the end
    for busy in (False, True):
        runs = [pieces(work, pool, calls, busy, kept) for _ in range(ROUNDS)]
        print(f"GPU {'busy' if busy else 'idle'}: median of {ROUNDS} captures of {KERNELS} kernels, us")
        for name in runs[0]:
            print(f"  {name:24s} {statistics.median(r[name] for r in runs):10.1f}")
        totals = []
        for _ in range(ROUNDS):
            torch.cuda.synchronize()
            if busy:
                torch.cuda._sleep(BUSY_CYCLES)
            start = time.perf_counter_ns()
            kept.append(CudaStepGraph(work, pool, calls))
            totals.append((time.perf_counter_ns() - start) / 1000)
        print(f"  {'CudaStepGraph (whole)':24s} {statistics.median(totals):10.1f}")
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
