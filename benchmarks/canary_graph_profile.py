"""Where the canary's time in a graphed model step goes, node by node.

``bench_e2e.py`` times the canary's ``before_forward`` + ``after_forward`` as one CUDA graph (its ``canary``
column).  This captures the same graph for a few of its points (the same tables: shuffled 16-slot pages, ground
truth on) and replays it under torch's profiler, which records every kernel, copy and memset inside a graph
replay: each node's device time, their sum, and the replay's wall time between two CUDA events.  The wall time
less the nodes' sum is what the graph's launch and the gaps between dependent nodes cost.

Usage: PYTHONPATH=src:benchmarks python benchmarks/canary_graph_profile.py --commit <sha> [--points ...]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import meta, save_result
from bench_e2e import Point, build_canary

POINTS = {"decode_b1_p512": Point(1, 512, 1), "decode_b32_p4k": Point(32, 4096, 1), "prefill_16k": Point(1, 0, 16384)}


def profile_point(name: str, pt: Point, replays: int) -> list[str]:
    world = build_canary(pt, torch.device("cuda"), torch.Generator().manual_seed(0))
    mgr = world.manager

    def canary() -> None:
        mgr.before_forward({"full": world.batch})
        mgr.after_forward()

    for _ in range(2):  # compile, and the first steps' one-off work
        canary()
        mgr.host_step(world.request_ids)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        canary()
    walls = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            walls.append(start.elapsed_time(end) * 1000.0)
            mgr.host_step(world.request_ids)
    nodes: dict[str, list[float]] = collections.defaultdict(list)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            nodes[ev.name[:70]].append(ev.device_time)
    lines = [f"## {name}: {replays} replays, wall median {statistics.median(walls):.2f} us (CUDA events)"]
    total = 0.0
    for node, times in sorted(nodes.items(), key=lambda kv: -sum(kv[1])):
        per = sum(times) / replays
        total += per
        lines.append(f"  {per:8.2f} us/replay  x{len(times) / replays:.0f}  {node}")
    lines.append(f"  {total:8.2f} us/replay  nodes' device time in all; the rest is launch and gaps")
    mgr.flush()
    stats = mgr.stats()
    if stats["violations"] or stats["health_failures"]:
        raise RuntimeError(f"{name}: the canary was not clean: {stats}")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--commit", default="unknown")
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--points", default=",".join(POINTS), help=f"comma-separated, of {', '.join(POINTS)}")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("canary_graph_profile needs a CUDA GPU", file=sys.stderr)
        return 2
    m = meta(args.commit, torch.device("cuda"))
    lines = [f"# The canary's graph, node by node: {m}"]
    for name in args.points.split(","):
        lines += profile_point(name, POINTS[name], args.replays)
        print("\n".join(lines[-12:]), flush=True)
    save_result(args.out, m["gpu"], args.commit, "-canary-graph.txt", "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
