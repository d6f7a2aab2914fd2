"""What launching the canary's real step graphs costs the host, and what is in them (not run by CI).

The demo's phase "plan/verify/stamp" is one graph launch a step (the canary's step graph, replayed) and the Python
around it.  This runs the demo's clean workload on CUDA with each captured graph's nodes counted by type (read from
the capture itself, just before it ends), then launches every kept graph again, timed on the host: with the GPU idle
before each launch, behind a stand-in engine step (many small kernels queued first, as the forward is), and behind
it with the host's caches flushed.  In a serving loop the launch runs cold: at a28f7b5 a launch took 2-4 us in a
loop while the phase read 28-93 us, and the CPU demo's cold proxy puts the Python of ``forward_step``'s replay path
at about 7 us.  A one-kernel graph is timed the same way, as the floor, launched by each way the canary can launch
(the CUDA runtime through ctypes, cuda-python's bindings, torch's replay).
Usage: PYTHONPATH=src python scripts/gpu/graph_launches.py [--model dense]
"""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from probe_args import demo_options

from kvcanary import demo
from kvcanary.adapters.transformers_cb import binding
from kvcanary.runtime import step_graphs
from kvcanary.runtime.cuda_calls import CudaCalls

ROUNDS = 200
FLUSH_BYTES = 256 << 20  # larger than any host CPU's last-level cache
ENGINE_KERNELS = 120  # about the engine's launches a step on the 2-layer demo models


def node_types(rt: Any) -> collections.Counter[str]:
    """The node types of the graph being captured on the current stream, so far ("unreadable": the bindings refused)."""
    try:
        info = rt.cudaStreamGetCaptureInfo(torch.cuda.current_stream().cuda_stream)
        _, _, count = rt.cudaGraphGetNodes(info[3], 0)
        _, nodes, count = rt.cudaGraphGetNodes(info[3], count)
        return collections.Counter(str(rt.cudaGraphNodeGetType(n)[1]).split(".")[-1] for n in nodes[:count])
    except Exception as exc:  # a probe: say what failed, keep the capture going
        print(f"node count failed: {exc!r}")
        return collections.Counter({"unreadable": 1})


def timed_launches(
    launch: Callable[[], None], engine: Callable[[], None] | None, flush: np.ndarray | None = None
) -> float:
    """Median host time of ``launch`` (us) over :data:`ROUNDS`, the GPU idle before each or behind ``engine``;
    with ``flush`` (a buffer larger than the CPU's caches), the host's caches flushed just before each launch, as
    a serving loop's engine step leaves them (the driver's launch path then runs cold)."""
    times = []
    for _ in range(ROUNDS):
        torch.cuda.synchronize()
        if engine is not None:
            engine()
        if flush is not None:
            flush += 1
        start = time.perf_counter_ns()
        launch()
        times.append((time.perf_counter_ns() - start) / 1000)
    torch.cuda.synchronize()
    return statistics.median(times)


def main() -> int:
    from cuda.bindings import runtime as rt

    opts = demo_options(__doc__.splitlines()[0])
    graphs: list[tuple[Any, collections.Counter[str]]] = []
    original = step_graphs.CudaStepGraph.__init__

    def counting(self: Any, work: Callable[[], None], pool: Any, calls: CudaCalls) -> None:
        types: collections.Counter[str] = collections.Counter()

        def counted() -> None:
            work()
            types.update(node_types(rt))

        original(self, counted, pool, calls)
        graphs.append((self, types))

    step_graphs.CudaStepGraph.__init__ = counting  # type: ignore[method-assign]
    # Every binding kept alive (its translator, manager and cache): the graphs read and write their buffers.
    bindings: list[object] = []
    bind = binding.Bindings.bind

    def keeping(self: binding.Bindings, runner: Any) -> Any:
        out = bind(self, runner)
        bindings.append(out[0])
        return out

    binding.Bindings.bind = keeping  # type: ignore[method-assign]
    model, prompts = demo.workload(opts)
    with demo.quiet_engine_logs():
        demo.run_workload(model, prompts, opts, label="graphs")
    x = torch.zeros(1 << 12, device="cuda")

    def engine() -> None:
        for _ in range(ENGINE_KERNELS):
            x.add_(1)

    floor = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(side):
        floor.capture_begin(capture_error_mode="thread_local")
        x.add_(1)
        floor.capture_end()
    calls = CudaCalls(torch.cuda.current_device())
    flush = np.zeros(FLUSH_BYTES, dtype=np.uint8)
    print(f"model {opts.model}: {len(graphs)} step graphs captured; host time of one launch, median of {ROUNDS} (us)")
    print(f"{'graph':<28}{'nodes':>6}{'idle':>9}{'behind':>9}{'cold':>9}  node types (cold: behind, caches flushed)")
    one = collections.Counter({"kernel": 1})
    rows = [
        (f"one kernel ({calls.path})", one, calls.graph_launch(floor)),
        ("one kernel (torch replay)", one, floor.replay),
    ]
    for path in ("cudart", "bindings"):  # the launch by each direct path, where it is there
        direct = CudaCalls(torch.cuda.current_device(), runtime=path)
        if direct.through_bindings and direct.path != calls.path:
            rows.append((f"one kernel ({direct.path})", one, direct.graph_launch(floor)))
    rows += [(f"step graph {i}", types, g.replay) for i, (g, types) in enumerate(graphs)]
    for name, types, launch in rows:
        idle, behind = timed_launches(launch, None), timed_launches(launch, engine)
        cold = timed_launches(launch, engine, flush)
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(types.items()))
        print(f"{name:<28}{sum(types.values()):>6}{idle:>9.1f}{behind:>9.1f}{cold:>9.1f}  {kinds}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
