"""The link kernels' tuning swept on a CUDA GPU: every combination of a grid of ``KernelTuning`` fields.

``bench_kernels --sweep`` compares a handful of hand-picked tunings; this times the whole product of the
fields given (verify block and warps and the grid's programs per SM by default: the verify kernel is
register-bound at large steps, so its tile and occupancy are what to search) over the scenarios that
stand for the kernel goals.  One line per tuning (per-step microseconds under graph replay, as
``bench_kernels``), then the best per scenario and the best overall (geometric mean of time / best).
Writes the table beside the results (``<gpu>-<commit>-kernel-sweep.txt``).

Usage: PYTHONPATH=src:benchmarks python benchmarks/kernel_sweep.py --commit <sha>
       [--field verify_block=512,1024,2048 ...] [--out DIR] [--replays N]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import statistics
import sys

import torch

from bench_kernels import build, goal_scenarios, save_result, time_kernels
from kvcanary.ops import launchers

GRID = {"verify_block": (512, 1024, 2048), "verify_warps": (4, 8, 16), "programs_per_sm": (2, 4, 8)}
PICKS = goal_scenarios()


def parse_fields(specs: list[str]) -> dict[str, tuple[int, ...]]:
    """``name=v1,v2`` per field (replacing that field's default values)."""
    grid = dict(GRID) if not specs else {}
    known = {f.name for f in dataclasses.fields(launchers.KernelTuning)}
    for spec in specs:
        name, _, values = spec.partition("=")
        if name not in known or not values:
            raise SystemExit(f"--field wants NAME=V1,V2 with NAME one of {sorted(known)}, got {spec!r}")
        grid[name] = tuple(int(v) for v in values.split(","))
    return grid


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", default=None)
    p.add_argument("--replays", type=int, default=12)
    p.add_argument("--rotations", type=int, default=2)
    p.add_argument("--field", action="append", default=[], help="NAME=V1,V2,... (repeatable)")
    p.add_argument("--scenarios", default=None, help="comma-separated names among the picks")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    grid = parse_fields(args.field)
    tunings = [launchers.KernelTuning(**dict(zip(grid, v, strict=True))) for v in itertools.product(*grid.values())]
    picks = [s for s in PICKS if args.scenarios is None or s.name in args.scenarios.split(",")]
    name = torch.cuda.get_device_name(dev)
    head = " ".join(grid) + " | " + " ".join(s.name for s in picks)
    lines = [f"# link kernel tuning sweep, commit {args.commit}, {name}; per-step us (graph replay median)", head]
    print("\n".join(lines), flush=True)
    times = {i: [] for i in range(len(tunings))}  # type: dict[int, list[float]]
    gen = torch.Generator().manual_seed(1)
    for s in picks:
        w = build(s, args.rotations, dev, gen)
        for i, t in enumerate(tunings):
            times[i].append(statistics.median(time_kernels(w, t, args.replays)))
        del w
        torch.cuda.empty_cache()
        print(f"{s.name} done", flush=True)
    best = [min(times[i][k] for i in times) for k in range(len(picks))]
    score = {i: math.exp(statistics.fmean(math.log(v / b) for v, b in zip(times[i], best, strict=True))) for i in times}
    for i, t in enumerate(tunings):
        vals = " ".join(str(getattr(t, f)) for f in grid)
        lines.append(f"{vals} | " + " ".join(f"{v:.2f}" for v in times[i]) + f" | score {score[i]:.3f}")
    for k, s in enumerate(picks):
        i = min(times, key=lambda i: times[i][k])
        lines.append(f"best {s.name}: {times[i][k]:.2f} us at {dataclasses.asdict(tunings[i])}")
    top = min(score, key=lambda i: score[i])
    default = next((i for i, t in enumerate(tunings) if t == launchers.DEFAULT_TUNING), None)
    lines.append(f"best overall (score {score[top]:.3f}): {tunings[top]}")
    if default is not None:
        lines.append(f"default (score {score[default]:.3f}): " + " ".join(f"{v:.2f}" for v in times[default]))
    print("\n".join(lines[2:]), flush=True)
    save_result(args.out, name, args.commit, "-kernel-sweep.txt", "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
