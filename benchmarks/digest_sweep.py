"""The KV digest kernel's tile shape and grid, swept on a CUDA GPU (which tuning reads fastest here).

Times one list call over 16,384 scattered slots of ``bench_digest``'s Qwen3-0.6B-shaped pool, stamp and
verify, under every combination of ``DigestTuning``'s words per step, warps, programs per SM and
components per unit.  Prints one line per tuning and writes the table beside the results
(``<gpu>-<commit>-digest-sweep.txt``); ``bench_digest.py`` then times its scenarios with the tuning it picks.

``--steps`` instead times decode steps' digest work (``bench_digest``'s b1 and b32 x 4k at the default
budget) under the small-launch fields (``small_block_words``, ``small_warps``; 64 words on 4 warps is
the streaming tile, i.e. no small-launch tile).

Usage: PYTHONPATH=src:benchmarks python benchmarks/digest_sweep.py --commit <sha> [--out DIR] [--quick] [--steps]
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch

from bench_common import copy_bandwidth, save_result
from bench_digest import Pool, list_throughput, step_cost
from kvcanary.config import DigestConfig
from kvcanary.ops import digest_launchers as dl

GRID = {"block_words": (32, 64, 128, 256), "warps": (2, 4, 8), "programs_per_sm": (8, 16),
        "max_comps_per_unit": (1, 2, 8)}  # fmt: skip
QUICK = {"block_words": (64, 128), "warps": (4,), "programs_per_sm": (8, 16), "max_comps_per_unit": (1, 8)}
SMALL = {"small_block_words": (64, 128, 256, 512), "small_warps": (4, 8)}
STEPS = ((1, 4096), (32, 4096))


def sweep_steps(pool: Pool, copy_gbps: float, replays: int, dev: torch.device) -> list[str]:
    """One line per small-launch tuning: each decode step's digest us (verify / stamp apart)."""
    head = " | ".join(f"b{b} x {p // 1024}k us (verify / stamp)" for b, p in STEPS)
    lines = ["small_block_words small_warps | " + head]
    for values in itertools.product(*SMALL.values()):
        t = dl.DigestTuning(**dict(zip(SMALL, values, strict=True)))
        cells = []
        for batch, prefix in STEPS:
            r = step_cost(pool, batch, prefix, 1, copy_gbps, replays, dev, DigestConfig(), t)
            cells.append(f"{r['us']:.2f} ({r['verify_us']:.2f} / {r['stamp_us']:.2f})")
        lines.append(" ".join(str(v) for v in values) + " | " + " | ".join(cells))
        print(lines[-1], flush=True)
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", default=None)
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="a few tunings only")
    p.add_argument("--steps", action="store_true", help="decode steps under the small-launch fields instead")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    pool = Pool(1 << 16, dev)
    copy_gbps = copy_bandwidth(dev) / 1e9
    grid = QUICK if args.quick else GRID
    name = torch.cuda.get_device_name(dev)
    if args.steps:
        lines = [f"# digest small-launch sweep, commit {args.commit}, {name}"]
        lines += sweep_steps(pool, copy_gbps, args.replays, dev)
        save_result(args.out, name, args.commit, "-digest-steps.txt", "\n".join(lines) + "\n")
        return 0
    lines = [f"# digest tuning sweep, commit {args.commit}, {name}, copy {copy_gbps:.0f} GB/s (read + written)",
             "block_words warps programs_per_sm comps | stamp GB/s (% copy) | verify GB/s (% copy)"]  # fmt: skip
    print("\n".join(lines), flush=True)
    for values in itertools.product(*grid.values()):
        t = dl.DigestTuning(**dict(zip(grid, values, strict=True)))
        res = [list_throughput(pool, 16384, True, stamp, args.replays, dev, t)["gbps"] for stamp in (True, False)]
        cells = [f"{g:.0f} ({100 * g / copy_gbps:.1f})" for g in res]
        line = " ".join(str(v) for v in values) + " | " + " | ".join(cells)
        lines.append(line)
        print(line, flush=True)
    save_result(args.out, name, args.commit, "-digest-sweep.txt", "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
