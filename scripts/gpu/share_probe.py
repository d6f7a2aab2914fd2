"""Where the canary's share of step time comes from beyond its per-step host time (not run by CI).

On the H200 the hybrid demo ran 0.49 s longer with the canary (3.29 s against 2.80 s over 352 steps: 1.4 ms a
step) while the tap's timer counted 0.36 ms a step.  This runs the demo's clean workload (``kvcanary demo``'s
model and prompts) alternately with the canary off (mode ``off``, as ``--baseline`` times it) and on, and for
each run reports:
- its wall time, split into the engine loop's thread (cProfile on that thread alone: Python 3.12 allows one
  profiler at a time) and everything else (the caller's thread: manager set-up, the canary's install);
- the engine thread's top functions by own time, so the two sides can be compared line by line, and the
  canary's functions by cumulative time (every hook, the offload mirror and fork copies too, not only the tap);
- the synchronising CUDA calls each side makes, by Python call site (torch's sync debug mode, ``warn``);
- the garbage collections each side triggers, by generation: a full collection walks every object the process
  tracks (the engine's and the model's too), so objects the canary allocates a step cost the engine's time.

Usage: PYTHONPATH=src python scripts/gpu/share_probe.py [--model hybrid] [--top 25]
"""

from __future__ import annotations

import collections
import contextlib
import cProfile
import gc
import io
import pstats
import time
import warnings
from collections.abc import Iterator
from typing import Any

import probe_args
import torch

from kvcanary import demo
from kvcanary.config import CanaryConfig, Mode


@contextlib.contextmanager
def profiled_engine_loop(prof: cProfile.Profile) -> Iterator[list[float]]:
    """``prof`` enabled around the engine's generation loop (its own thread); yields the loop's wall seconds."""
    from transformers.generation.continuous_batching import continuous_api

    cls = continuous_api.ContinuousBatchingManager
    original = cls._run_generation_loop
    seconds: list[float] = []

    def loop(self: Any, *a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        prof.enable()
        try:
            return original(self, *a, **k)
        finally:
            prof.disable()
            seconds.append(time.perf_counter() - start)

    cls._run_generation_loop = loop  # type: ignore[method-assign]
    try:
        yield seconds
    finally:
        cls._run_generation_loop = original  # type: ignore[method-assign]


@contextlib.contextmanager
def sync_sites(cuda: bool) -> Iterator[collections.Counter[str]]:
    """The synchronising CUDA calls made in the block, by the Python line that made them."""
    sites: collections.Counter[str] = collections.Counter()
    if cuda:
        torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield sites
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
    for w in caught:
        if "synchroniz" in str(w.message):
            sites[f"{w.filename.rsplit('/', 3)[-1]}:{w.lineno}"] += 1


def one_run(
    model: torch.nn.Module, prompts: list[list[int]], opts: demo.DemoOptions, canary: bool, top: int
) -> dict[str, Any]:
    from kvcanary.adapters.transformers_cb import install

    prof = cProfile.Profile()
    mode = Mode.LOG if canary else Mode.OFF
    collections_before = [g["collections"] for g in gc.get_stats()]
    with profiled_engine_loop(prof) as loop_s, sync_sites(opts.device == "cuda") as sites:
        start = time.perf_counter()
        with install(model, CanaryConfig(mode=mode)) as c:
            demo.generate_waves(model, prompts, opts)
            steps = c.stats()["steps"] if canary else 0
        total = time.perf_counter() - start
    collections = [g["collections"] - b for g, b in zip(gc.get_stats(), collections_before, strict=True)]
    out, own = io.StringIO(), io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    pstats.Stats(prof, stream=own).sort_stats("cumulative").print_stats("kvcanary", top)
    return {
        "total": total, "loop": sum(loop_s), "steps": steps, "sites": sites, "profile": out.getvalue(),
        "collections": collections,
        "canary": own.getvalue() if canary else "",
    }  # fmt: skip


def main() -> None:
    p = probe_args.demo_parser(__doc__.splitlines()[0], default_model="hybrid")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--requests", type=int, default=64)
    args = p.parse_args()
    opts = probe_args.options_of(args, requests=args.requests)
    model, prompts = demo.workload(opts)
    with demo.quiet_engine_logs():
        demo.run_workload(model, prompts, opts, label="warm-up")
        runs = [(side, one_run(model, prompts, opts, side, args.top)) for side in (False, True, False, True)]
    for i, (side, r) in enumerate(runs):
        name = "with the canary" if side else "canary off"
        print(f"=== {name}: {r['total']:.3f} s in all, engine loop {r['loop']:.3f} s, steps {r['steps']}")
        print("synchronising calls by site:", dict(r["sites"].most_common(15)))
        print("garbage collections by generation:", r["collections"])
        if i >= 2:  # the second run of each side in full (warmer)
            print(r["profile"])
            if r["canary"]:
                print("the canary's own functions by cumulative time (its hooks in and around the step):")
                print(r["canary"])


if __name__ == "__main__":
    main()
