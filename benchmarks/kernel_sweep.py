"""The link kernels' tuning swept on a CUDA GPU: a grid of ``KernelTuning`` fields, or a hand-picked list.

``--field`` (default: verify block and warps and the grid's programs per SM: the verify kernel is
register-bound at large steps, so its tile and occupancy are what to search) times every combination of
the values given; ``--hand-picked`` times :data:`HAND_PICKED` instead (single-field neighbours of the
default and a few mixed stamp/verify variants that a grid cannot express).  Both time the scenarios that
stand for the kernel goals (``bench_kernels.goal_scenarios``).  One line per tuning (per-step
microseconds under graph replay, as ``bench_kernels``), then the best per scenario and the best overall
(geometric mean of time / best).  Writes the table beside the results (``<gpu>-<commit>-kernel-sweep.txt``)
and, with ``--best-json``, the best tuning for ``bench_kernels --tuning-json``.

Usage: PYTHONPATH=src:benchmarks python benchmarks/kernel_sweep.py --commit <sha>
       [--field verify_block=512,1024,2048 ... | --hand-picked] [--best-json PATH] [--out DIR] [--replays N] [--page N]
       [--dry-run: toy scenarios on the CPU interpreter, TRITON_INTERPRET=1]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import statistics
import sys
from pathlib import Path

import torch

from bench_common import save_result
from bench_kernels import build, goal_scenarios, scenarios, time_kernels
from kvcanary.ops import launchers

GRID = {"verify_block": (512, 1024, 2048), "verify_warps": (4, 8, 16), "programs_per_sm": (2, 4, 8)}
_T = launchers.KernelTuning
HAND_PICKED = {
    "default": launchers.DEFAULT_TUNING,
    "g1": _T(programs_per_sm=1),
    "g2": _T(programs_per_sm=2),
    "g8": _T(programs_per_sm=8),
    "vw8": _T(verify_warps=8),
    "v2048w8": _T(verify_block=2048, verify_warps=8),
    "v128w4": _T(verify_block=128, verify_warps=4),
    "sw4": _T(stamp_warps=4),
    "s256w4": _T(stamp_block=256, stamp_warps=4, carry_block=256),
    # The verify's registers capped so that more of its programs fit an SM (ncu: occupancy capped by registers).
    "r64g8": _T(verify_maxnreg=64, programs_per_sm=8),
    "r80g6": _T(verify_maxnreg=80, programs_per_sm=6),
    "r96g5": _T(verify_maxnreg=96, programs_per_sm=5),
}


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


def tunings_of(args: argparse.Namespace) -> tuple[str, dict[str, launchers.KernelTuning]]:
    """(the table's label header, tunings by label): the hand-picked list or the grid's product."""
    if args.hand_picked:
        names = args.picked.split(",") if args.picked else list(HAND_PICKED)
        unknown = sorted(set(names) - set(HAND_PICKED))
        if unknown:
            raise SystemExit(f"--picked: {unknown} not among {sorted(HAND_PICKED)}")
        return "tuning", {n: HAND_PICKED[n] for n in names}
    grid = parse_fields(args.field)
    out = {}
    for values in itertools.product(*grid.values()):
        out[" ".join(str(v) for v in values)] = launchers.KernelTuning(**dict(zip(grid, values, strict=True)))
    return " ".join(grid), out


def sweep(tunings: dict[str, launchers.KernelTuning], picks: list, args: argparse.Namespace, dev: torch.device
          ) -> dict[str, list[float]]:  # fmt: skip
    """Per-step median microseconds of every tuning on every scenario (one world built per scenario)."""
    times: dict[str, list[float]] = {k: [] for k in tunings}
    gen = torch.Generator().manual_seed(1)
    for s in picks:
        w = build(s, args.rotations, dev, gen)
        for k, t in tunings.items():
            times[k].append(statistics.median(time_kernels(w, t, args.replays)))
            print(f"{s.name} {k}: {times[k][-1]:.2f} us", flush=True)  # kept in the log if the sweep is cut short
        del w
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        print(f"{s.name} done", flush=True)
    return times


def report(label: str, tunings: dict[str, launchers.KernelTuning], picks: list, times: dict[str, list[float]]
           ) -> tuple[list[str], str]:  # fmt: skip
    """(the table's lines, the best tuning's label by geometric mean of time / best time)."""
    best = [min(times[k][i] for k in times) for i in range(len(picks))]
    score = {k: math.exp(statistics.fmean(math.log(v / b) for v, b in zip(times[k], best, strict=True))) for k in times}
    lines = [f"{label} | " + " ".join(s.name for s in picks)]
    lines += [f"{k} | " + " ".join(f"{v:.2f}" for v in times[k]) + f" | score {score[k]:.3f}" for k in tunings]
    for i, s in enumerate(picks):
        k = min(times, key=lambda k: times[k][i])
        lines.append(f"best {s.name}: {times[k][i]:.2f} us at {dataclasses.asdict(tunings[k])}")
    top = min(score, key=lambda k: score[k])
    lines.append(f"best overall (score {score[top]:.3f}): {top} {tunings[top]}")
    default = next((k for k, t in tunings.items() if t == launchers.DEFAULT_TUNING), None)
    if default is not None:
        lines.append(f"default (score {score[default]:.3f}): " + " ".join(f"{v:.2f}" for v in times[default]))
    return lines, top


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", default=None)
    p.add_argument("--replays", type=int, default=12)
    p.add_argument("--rotations", type=int, default=2)
    p.add_argument("--field", action="append", default=[], help="NAME=V1,V2,... (repeatable)")
    p.add_argument("--hand-picked", action="store_true", help="time HAND_PICKED instead of a grid")
    p.add_argument("--picked", default=None, help="with --hand-picked: comma-separated names among HAND_PICKED")
    p.add_argument("--best-json", default=None, help="write the best tuning here (for bench_kernels --tuning-json)")
    p.add_argument(
        "--scenarios",
        default=None,
        help="comma-separated names among the kernel table's scenarios (default: the goal scenarios)",
    )
    p.add_argument("--page", type=int, default=1, help="block tables of this page size (bench_kernels --page)")
    p.add_argument("--dry-run", action="store_true", help="toy scenarios on the CPU interpreter (harness check)")
    args = p.parse_args()
    if args.hand_picked and args.field:
        raise SystemExit("--hand-picked and --field are two ways to name the tunings: give one")
    if args.dry_run:
        dev = torch.device("cpu")
    elif torch.cuda.is_available():
        dev = torch.device("cuda")
    else:
        print("no CUDA device (or --dry-run under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    label, tunings = tunings_of(args)
    if args.dry_run:
        picks = scenarios(False, tiny=True, page=args.page)[:1]
    elif args.scenarios is None:
        picks = goal_scenarios(args.page)
    else:  # any of the kernel table's scenarios, by name
        names = args.scenarios.split(",")
        picks = [s for s in scenarios(False, page=args.page) if s.name in names]
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu-dry-run"
    times = sweep(tunings, picks, args, dev)
    lines, top = report(label, tunings, picks, times)
    lines.insert(0, f"# link kernel tuning sweep, commit {args.commit}, {name}; per-step us (graph replay median)")
    print("\n".join(lines), flush=True)
    save_result(args.out, name, args.commit, "-kernel-sweep.txt", "\n".join(lines) + "\n")
    if args.best_json:
        Path(args.best_json).write_text(json.dumps(dataclasses.asdict(tunings[top])) + "\n")
        print(f"wrote {args.best_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
