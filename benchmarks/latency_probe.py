"""What one dependent global-memory round trip and one graph-replayed launch cost on this GPU.

A small step's kernels are latency chains (a load whose address comes from the previous load: table,
lookup, record; then the ticket and the finalize), so their floor is launches x launch cost + hops x
hop cost, not bytes / bandwidth.  This measures both terms with one program of one thread chasing a
random cycle of indices: ``hops`` dependent loads per launch, in an array that fits the L2 cache and
one that does not; and the launch alone (0 hops: one load and one store).  The per-hop cost is the
slope between hop counts, each point the median of CUDA-graph replays of ``LAUNCHES`` launches.

Usage: PYTHONPATH=src:benchmarks python benchmarks/latency_probe.py --commit <sha> [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import triton
import triton.language as tl

from bench_common import meta, save_records, time_graph

LAUNCHES = 32
HOPS = (0, 8, 32, 128)
SIZES = {"l2": 1 << 20, "dram": 1 << 28}  # int64 entries: 8 MiB (in the 50 MiB L2), 2 GiB (far beyond it)


@triton.jit
def chase_kernel(next_ptr, at_ptr, hops):
    # Each launch goes on where the last stopped: replays never revisit an entry of the large array, so
    # its hops miss the cache (the starting load is one more hop, the same at every count).
    i = tl.load(at_ptr)
    for _ in range(hops):
        i = tl.load(next_ptr + i)
    tl.store(at_ptr, i)


def cycle(n: int, dev: torch.device) -> torch.Tensor:
    """next[i] for one random cycle through all n entries (each hop lands far from the last)."""
    order = torch.randperm(n, device=dev)
    nxt = torch.empty(n, dtype=torch.int64, device=dev)
    nxt[order] = torch.roll(order, -1)
    return nxt


def per_launch_us(nxt: torch.Tensor, out: torch.Tensor, hops: int, replays: int) -> float:
    def record() -> None:
        for _ in range(LAUNCHES):
            chase_kernel[(1,)](nxt, out, hops, num_warps=1)

    record()
    return statistics.median(time_graph(record, LAUNCHES, replays))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", default=None)
    p.add_argument("--replays", type=int, default=20)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    out = torch.zeros(1, dtype=torch.int64, device=dev)
    records = []
    for name, n in SIZES.items():
        nxt = cycle(n, dev)
        times = {h: per_launch_us(nxt, out, h, args.replays) for h in HOPS}
        slope = (times[HOPS[-1]] - times[HOPS[1]]) / (HOPS[-1] - HOPS[1])
        rec = {"scenario": f"latency_{name}", "entries": n, "us_by_hops": times, "us_per_hop": round(slope, 4),
               "launch_us": round(times[0], 3)}  # fmt: skip
        records.append(rec)
        print(json.dumps(rec), flush=True)
        del nxt
        torch.cuda.empty_cache()
    m = meta(args.commit, dev)
    save_records(args.out, m, args.commit, "-latency.json", records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
