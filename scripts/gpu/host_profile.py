"""Where the canary's host time goes on the GPU demo: cProfile around the adapter's step tap.

Runs the demo's clean workload (``kvcanary demo``'s model and prompts, no fault) on CUDA with a profiler
enabled only inside ``StepTap._tap`` (the engine thread), and prints the tap timer's
per-phase means and the top functions by own time and by cumulative time.  The profiler inflates the
absolute numbers (each Python call costs more under it); the split is what this is for.

Usage: PYTHONPATH=src python scripts/gpu/host_profile.py [--model dense|hybrid|sliding] [--device cuda]
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import pstats
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import probe_args
import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from kvcanary import demo
from kvcanary.adapters.transformers_cb.step_tap import StepTap


@contextlib.contextmanager
def profiled_taps() -> Iterator[cProfile.Profile]:
    """A profiler enabled only inside ``StepTap._tap`` (on the engine's thread) for the block."""
    prof = cProfile.Profile()
    original = StepTap._tap

    def tap(self: Any, *a: Any, **k: Any) -> None:
        prof.enable()
        try:
            original(self, *a, **k)
        finally:
            prof.disable()

    StepTap._tap = tap  # type: ignore[method-assign]
    try:
        yield prof
    finally:
        StepTap._tap = original  # type: ignore[method-assign]


def call_costs(device: str) -> dict[str, float]:
    """Median host time (us) of a few torch calls the tap makes, on small tensors, where it is called from."""
    small = torch.zeros(64, dtype=torch.int64, device=device)
    index = torch.arange(8, device=device)
    calls = {
        "reshape": lambda: small.reshape(-1),
        "slice": lambda: small[:8],
        "index_copy_": lambda: small.index_copy_(0, index, index),
        "empty_pinned": lambda: torch.empty(4096, dtype=torch.uint8, pin_memory=device == "cuda"),
    }
    out = {}
    for name, call in calls.items():
        times = []
        for _ in range(200):
            start = time.perf_counter_ns()
            call()
            times.append(time.perf_counter_ns() - start)
        out[name] = round(statistics.median(times) / 1000, 2)
    return out


@contextlib.contextmanager
def tap_probe(device: str, at_tap: int = 20) -> Iterator[dict[str, Any]]:
    """What the engine's thread looks like inside the tap (at its ``at_tap``-th call): the torch modes and Python
    hooks in force, and the cost of a few torch calls there; the same calls outside it (``outside``)."""
    found: dict[str, Any] = {"outside": call_costs(device)}
    original = StepTap._tap
    count = [0]

    def tap(self: Any, *a: Any, **k: Any) -> None:
        count[0] += 1
        if count[0] == at_tap:
            found.update(
                function_modes=[type(m).__name__ for m in _get_current_function_mode_stack()],
                dispatch_modes=[type(m).__name__ for m in _get_current_dispatch_mode_stack()],
                profiler=repr(sys.getprofile()), tracer=repr(sys.gettrace()), threads=threading.active_count(),
                inference_mode=torch.is_inference_mode_enabled(), grad=torch.is_grad_enabled(),
                inside=call_costs(device),
            )  # fmt: skip
        original(self, *a, **k)

    StepTap._tap = tap  # type: ignore[method-assign]
    try:
        yield found
    finally:
        StepTap._tap = original  # type: ignore[method-assign]


def print_profile(prof: cProfile.Profile, top: int) -> None:
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).strip_dirs().sort_stats(key).print_stats(top)
        print(f"--- by {key}\n" + "\n".join(line for line in buf.getvalue().splitlines() if line.strip()))


def main() -> int:
    p = probe_args.demo_parser(__doc__.splitlines()[0])
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    opts = probe_args.options_of(args)
    model, prompts = demo.workload(opts)
    with demo.quiet_engine_logs():
        demo.run_workload(model, prompts, opts, label="warm-up")  # compile the kernels, warm the allocators
        with profiled_taps() as prof:
            result = demo.run_workload(model, prompts, opts, label="profiled")
    s = result.stats
    steps = max(s["steps"], 1)
    phases = {
        k[4:-3] or "total": round(v / steps, 1) for k, v in s.items() if k.startswith("tap_") and k.endswith("_us")
    }
    phases.pop("median", None)
    print(f"model {args.model}: {s['steps']} steps, host us per step under the profiler: {phases}")
    print_profile(prof, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
