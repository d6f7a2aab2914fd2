"""Does work like the canary's, run between two engine steps, make the engine's own next step slower? (not run by CI)

The phase probe finds the engine's ``compute_batch`` running longer with the canary on than off, beyond the tap's
own timer.  Two causes would show that way: the CPU caches the tap's Python leaves cold for the engine, or the
canary's CUDA calls (a graph launch, two copies, an event) making the engine's next launches cost more in the
driver.  This times a stand-in engine step (a small model's launches on one stream, then a wait for its output,
as a serving loop does) after each kind of work in turn, in interleaved blocks, and prints the median host time of
the engine step after each:

- ``nothing``: no work between the steps;
- ``python``: Python that touches about as many objects as a steady tap (attribute reads over a few thousand
  small objects, no CUDA call);
- ``graph``: one replay of a captured graph of a few small kernels;
- ``copies``: a host-to-device copy from pinned memory, a device-to-host copy into pinned memory and an event
  recorded and queried, through torch;
- ``graph+copies``: both, as a steady tap issues them.

Usage: python scripts/gpu/launch_interference.py [--steps 2000] [--layers 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch


def engine_step(layers: list[torch.Tensor], x: torch.Tensor) -> Callable[[], None]:
    """A stand-in step: per layer a few small ops (about a 2-layer model's launches), then the output read back."""

    def step() -> None:
        h = x
        for w in layers:
            for _ in range(8):
                h = torch.nn.functional.silu(h @ w) + h
                h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        int(h[0].argmax())  # the engine waits for its sampled tokens

    return step


def python_work(n: int = 3000) -> Callable[[], None]:
    class Item:
        __slots__ = ("a", "b", "c")

        def __init__(self, i: int) -> None:
            self.a, self.b, self.c = i, [i], {"k": i}

    items = [Item(i) for i in range(n)]

    def work() -> None:
        total = 0
        for it in items:
            total += it.a + it.b[0] + it.c["k"]

    return work


def graph_work() -> Callable[[], None]:
    buf = torch.zeros(4096, device="cuda", dtype=torch.int64)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):  # warm-up before capture
            buf.add_(1)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(5):
            buf.add_(1)
            buf.mul_(1)
    return g.replay


def copy_work() -> Callable[[], None]:
    host_in = torch.zeros(1024, dtype=torch.int64, pin_memory=True)
    host_out = torch.zeros(2048, dtype=torch.int64, pin_memory=True)
    dev_in = torch.zeros(1024, dtype=torch.int64, device="cuda")
    dev_out = torch.zeros(2048, dtype=torch.int64, device="cuda")
    event = torch.cuda.Event()

    def work() -> None:
        event.query()
        dev_in.copy_(host_in, non_blocking=True)
        host_out.copy_(dev_out, non_blocking=True)
        event.record()

    return work


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000, help="engine steps timed after each kind of work")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--block", type=int, default=50, help="steps in a row of one kind (kinds interleave by block)")
    args = p.parse_args()
    torch.manual_seed(0)
    layers = [torch.randn(256, 256, device="cuda") / 16 for _ in range(args.layers)]
    step = engine_step(layers, torch.randn(64, 256, device="cuda"))
    graph, copies, py = graph_work(), copy_work(), python_work()

    def both() -> None:
        graph()
        copies()

    kinds: dict[str, Callable[[], None]] = {
        "nothing": lambda: None, "python": py, "graph": graph, "copies": copies, "graph+copies": both,
    }  # fmt: skip
    times: dict[str, list[int]] = {k: [] for k in kinds}
    for _ in range(20):  # warm-up
        for work in kinds.values():
            work()
            step()
    torch.cuda.synchronize()
    for _ in range(args.steps // args.block):
        for name, work in kinds.items():
            for _ in range(args.block):
                work()
                start = time.perf_counter_ns()
                step()
                times[name].append(time.perf_counter_ns() - start)
    base = statistics.median(times["nothing"]) / 1000
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: engine step (host us, median of {args.steps})")
    for name, t in times.items():
        m = statistics.median(t) / 1000
        print(f"  after {name:<13} {m:8.1f}  ({m - base:+.1f})")


if __name__ == "__main__":
    main()
