"""The device ops the transformers adapter's mirror of the engine's block moves makes, counted on the CPU demo.

Each op the mirror makes is a launch of host time on CUDA (tens of microseconds with the caches cold between two
engine steps), and on the hybrid GPU demo the mirror is about a third of the canary's timed work.  A count does not
move with the machine the way a time does: the demo's clean workload (``kvcanary demo``'s model, prompts and CPU
offload, no fault) runs on the CPU with a dispatch mode active only inside the mirror's timed window (between the
two clock readings of ``BulkMoveWrappers.mirror_ns``), counting every non-view aten op, and the host index builds
(:func:`kvcanary.layout.block_index`: on CUDA a pinned tensor and its copy, two ops; on the CPU one tensor, not an
aten op) counted apart.  ``cuda_ops`` = ops + 2 x index builds: what the same moves cost on CUDA.

Runs against whatever ``kvcanary`` is on the path, so an older tree is counted by putting its ``src`` first.

Usage: PYTHONPATH=src:benchmarks python benchmarks/mirror_ops.py [--models dense,hybrid,sliding] [--commit <sha>]
       [--out DIR]   (about 20 s a model)
"""

from __future__ import annotations

import argparse
import collections
import time
import types
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import bench_common
from kvcanary import demo
from kvcanary.adapters.transformers_cb import bulk_moves, mirror


class _Ops(TorchDispatchMode):
    def __init__(self, counts: collections.Counter[str]) -> None:
        super().__init__()
        self._counts = counts

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not func.is_view:
            self._counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


class MirrorWindows:
    """Stands in for ``bulk_moves.time``: the mirror reads ``perf_counter_ns`` once at the start of its window and
    once at the end (the only reads in the module), so the readings alternate opening and closing a counted window."""

    def __init__(self) -> None:
        self.ops: collections.Counter[str] = collections.Counter()
        self.windows = 0
        self._mode: _Ops | None = None

    def perf_counter_ns(self) -> int:
        if self._mode is None:
            self._mode = _Ops(self.ops)
            self._mode.__enter__()
        else:
            self._mode.__exit__(None, None, None)
            self._mode = None
            self.windows += 1
        return time.perf_counter_ns()


def count(model: str) -> dict[str, Any]:
    windows, builds = MirrorWindows(), [0]
    real_index = mirror.block_index

    def block_index(blocks: Any, device: torch.device) -> torch.Tensor:
        builds[0] += 1
        return real_index(blocks, device)

    saved = bulk_moves.time, mirror.block_index
    bulk_moves.time, mirror.block_index = types.SimpleNamespace(perf_counter_ns=windows.perf_counter_ns), block_index
    options = demo.DemoOptions(model=model)
    try:
        with demo.quiet_engine_logs():
            run = demo.run_workload(*demo.workload(options), options, label="clean")
    finally:
        bulk_moves.time, mirror.block_index = saved
    ops = sum(windows.ops.values())
    return {
        "scenario": f"mirror_ops_{model}",
        "model": model,
        "steps": run.stats["steps"],
        "features": {k: run.features[k] for k in ("fork_block_copies", "offloads", "restores")},
        "moves": windows.windows,
        "ops": ops,
        "index_builds": builds[0],
        "cuda_ops": ops + 2 * builds[0],
        "by_op": dict(windows.ops.most_common()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="dense,hybrid,sliding")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--out", default=None, help="results folder (default: print only)")
    args = ap.parse_args()
    records = [count(m) for m in args.models.split(",")]
    for r in records:
        print(
            f"{r['model']:8s} {r['steps']} steps, {r['moves']} mirrored moves: {r['ops']} ops + {r['index_builds']} "
            f"index builds = {r['cuda_ops']} ops on CUDA ({r['cuda_ops'] / max(r['moves'], 1):.1f} a move)"
        )
    if args.out:
        m = bench_common.meta(args.commit, torch.device("cpu"))
        bench_common.save_records(args.out, m, args.commit, "-mirror-ops.json", records)


if __name__ == "__main__":
    main()
