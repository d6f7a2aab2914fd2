"""What the first steps of a run cost with the canary on (not run by CI).

``step_times.py`` found the time a canary run adds concentrated in its first steps: on an H100 at 3ce2a60 the first
step of a dense demo run took 19 ms longer with the canary than without it, the second 2.9 ms and the third 1.5 ms,
a tenth of all the time the run added, while the demo's timed set-up was 3 ms a run.  This runs the demo's clean
workload (after a warm-up run of each side, as ``kvcanary demo --baseline`` does), with the canary off and then on,
and profiles the engine loop's first ``--steps`` bodies that ran a step (cProfile, the engine's thread): each
body's seconds, then the canary run's top functions by cumulative and by own time.

Usage: PYTHONPATH=src python scripts/gpu/first_steps.py [--model dense] [--steps 3] [--top 40]
"""

from __future__ import annotations

import contextlib
import cProfile
import gc
import io
import pstats
import time
from collections.abc import Iterator
from typing import Any

import probe_args
import torch

from kvcanary import demo
from kvcanary.adapters.transformers_cb import install
from kvcanary.config import CanaryConfig, Mode


@contextlib.contextmanager
def first_bodies(prof: cProfile.Profile, steps: int) -> Iterator[list[float]]:
    """``prof`` enabled in the engine loop's bodies until ``steps`` of them ran a step; yields those bodies'
    seconds (bodies that only waited for requests are profiled too, not listed)."""
    from transformers.generation.continuous_batching import continuous_api

    cls = continuous_api.ContinuousBatchingManager
    original = cls.__dict__["_generation_loop_body"]
    seconds: list[float] = []

    def body(manager: Any, *a: Any, **k: Any) -> Any:
        if len(seconds) >= steps:
            return original(manager, *a, **k)
        before = getattr(manager, "current_batch", None)
        start = time.perf_counter()
        prof.enable()
        try:
            return original(manager, *a, **k)
        finally:
            prof.disable()
            if getattr(manager, "current_batch", None) != before:
                seconds.append(time.perf_counter() - start)

    cls._generation_loop_body = body
    try:
        yield seconds
    finally:
        cls._generation_loop_body = original


def one_run(model: Any, prompts: list[list[int]], opts: demo.DemoOptions, canary: bool, steps: int) -> Any:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prof = cProfile.Profile()
    with (
        install(model, CanaryConfig(mode=Mode.LOG if canary else Mode.OFF)),
        first_bodies(prof, steps) as seconds,
    ):
        demo.generate_waves(model, prompts, opts)
    return prof, seconds


def main() -> None:
    p = probe_args.demo_parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args()
    opts = probe_args.options_of(args)
    model, prompts = demo.workload(opts)
    with demo.quiet_engine_logs():
        for side in (False, True):  # warm-up, as the demo's
            one_run(model, prompts, opts, side, 0)
        _, off = one_run(model, prompts, opts, False, args.steps)
        prof, on = one_run(model, prompts, opts, True, args.steps)
    print(f"model {args.model}: the first {args.steps} steps' bodies, ms (profiled)")
    print("  off: " + ", ".join(f"{s * 1e3:.2f}" for s in off))
    print("  on:  " + ", ".join(f"{s * 1e3:.2f}" for s in on))
    for key in ("cumulative", "tottime"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).strip_dirs().sort_stats(key).print_stats(args.top)
        print(f"--- canary on, by {key}\n" + "\n".join(ln for ln in buf.getvalue().splitlines() if ln.strip()))


if __name__ == "__main__":
    main()
