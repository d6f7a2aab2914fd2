"""Where the canary's host time goes on the GPU demo: cProfile around the adapter's step tap, its mirror, its set-up.

Runs the demo's clean workload (``kvcanary demo``'s model and prompts, no fault) on CUDA with a profiler
enabled only inside the parts named by ``--targets`` (the engine thread): ``tap`` (``StepTap._tap``), ``mirror``
(the wrappers of the engine's bulk KV moves, the engine's own move included) and ``setup`` (``Bindings.bind``,
which makes each cache's canary), one profiled run each, and prints the tap timer's
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
from kvcanary.adapters.transformers_cb.binding import Bindings
from kvcanary.adapters.transformers_cb.bulk_moves import BulkMoveWrappers
from kvcanary.adapters.transformers_cb.step_tap import StepTap

# What each target profiles: (class, method, whether the method is a factory whose returned wrapper is profiled).
TARGETS: dict[str, tuple[tuple[type, str, bool], ...]] = {
    "tap": ((StepTap, "_tap", False),),
    "mirror": tuple((BulkMoveWrappers, name, True) for name in ("copy_blocks", "cache_copy", "offload", "restore")),
    "setup": ((Bindings, "bind", False),),
}


def _profiled(prof: cProfile.Profile, fn: Any, depth: list[int]) -> Any:
    """``fn`` with ``prof`` enabled inside it; ``depth`` is shared by every wrapper on ``prof``, so that a profiled
    call inside another (the fork copy's wrapper around each group's copy) leaves the profiler to the outer one."""

    def run(*a: Any, **k: Any) -> Any:
        depth[0] += 1
        if depth[0] == 1:
            prof.enable()
        try:
            return fn(*a, **k)
        finally:
            depth[0] -= 1
            if depth[0] == 0:
                prof.disable()

    return run


@contextlib.contextmanager
def profiled(target: str) -> Iterator[cProfile.Profile]:
    """A profiler enabled only inside ``target``'s methods (see :data:`TARGETS`; on the engine's thread)."""
    prof = cProfile.Profile()
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in TARGETS[target]]
    depth = [0]
    for (owner, name, factory), (_, _, original) in zip(TARGETS[target], saved, strict=True):
        if factory:
            setattr(owner, name, lambda self, engine_fn, f=original: _profiled(prof, f(self, engine_fn), depth))
        else:
            setattr(owner, name, _profiled(prof, original, depth))
    try:
        yield prof
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


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
    p.add_argument("--targets", default="tap", help="comma-separated: tap, mirror, setup (one profiled run each)")
    args = p.parse_args()
    targets = args.targets.split(",")
    if unknown := set(targets) - set(TARGETS):
        p.error(f"unknown targets {sorted(unknown)}: choose from {sorted(TARGETS)}")
    opts = probe_args.options_of(args)
    model, prompts = demo.workload(opts)
    with demo.quiet_engine_logs():
        demo.run_workload(model, prompts, opts, label="warm-up")  # compile the kernels, warm the allocators
        for target in targets:
            with profiled(target) as prof:
                result = demo.run_workload(model, prompts, opts, label="profiled")
            report(args.model, target, result.stats, prof, args.top)
    return 0


def report(model: str, target: str, s: dict[str, Any], prof: cProfile.Profile, top: int) -> None:
    """The run's tap phases per step, then the profile of ``target``."""
    steps = max(s["steps"], 1)
    phases = {
        k[4:-3] or "total": round(v / steps, 1) for k, v in s.items() if k.startswith("tap_") and k.endswith("_us")
    }
    phases.pop("median", None)
    mirror, setup = round(s.get("mirror_us", 0) / steps, 1), round(s.get("setup_us", 0) / steps, 1)
    print(
        f"=== model {model}, profiled: {target}; {s['steps']} steps, host us per step: {phases}, "
        f"mirror {mirror}, set-up {setup}"
    )
    print_profile(prof, top)


if __name__ == "__main__":
    sys.exit(main())
