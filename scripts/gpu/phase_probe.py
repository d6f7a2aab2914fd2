"""Where in the engine's loop the time the canary adds lands (not run by CI).

The demo's share line leaves part of the added time unattributed: "the rest", beyond the canary's own timed
host work (about 0.14 ms a step on the H100 at 0ff92b3, dense and hybrid).  This times the engine loop's phases
with plain clocks (no profiler: cProfile's own cost grows with the number of functions seen, and the canary
doubles that, so a profiled comparison slows the engine's functions too), with the canary off and on, in
alternating pairs like ``kvcanary demo --baseline``:
- ``schedule``: ``prepare_next_batch`` less its parts below (scheduling, offload decisions);
- ``offload`` / ``restore``: the offloading manager's calls (the canary mirrors their moves);
- ``tensors``: ``prepare_batch_tensors`` (the canary captures the host batch there);
- ``compute``: ``ModelRunner.compute_batch`` (the forward and sampling; the canary's step tap runs inside);
- ``engine compute``: the same method as the engine has it, timed inside the canary's wrapper (so without the tap):
  what ``compute`` adds beyond it and the tap's own timer is the wrapper's; what it adds itself, the engine's own
  forward running longer with the canary on (the CPU caches the tap left, the canary's CUDA calls before it);
- ``wait``: ``retrieve_device_outputs`` (the host waiting for the device: the canary's device work shows here);
- ``update``: ``update_batch`` (the engine's bookkeeping, fork copies the canary mirrors);
- ``outside``: the run's wall time outside the loop bodies (manager set-up and tear-down, thread hand-offs).
Each side's median over the pairs, per step, and the canary's own timed work by phase.

Usage: PYTHONPATH=src python scripts/gpu/phase_probe.py [--model hybrid] [--pairs 5]
"""

from __future__ import annotations

import collections
import contextlib
import gc
import importlib
import statistics
import time
from collections.abc import Iterator
from typing import Any

import probe_args

from kvcanary import demo
from kvcanary.config import CanaryConfig, Mode
from kvcanary.demo_timing import time_share

_CB = "transformers.generation.continuous_batching"
# (phase, module, class, method); prepare_next_batch contains offload, restore and tensors.
_TIMED = (
    ("next_batch", "continuous_api", "ContinuousBatchProcessor", "prepare_next_batch"),
    ("offload", "offloading_manager", "OffloadingManager", "offload_requests"),
    ("restore", "offloading_manager", "OffloadingManager", "restore_scheduled_requests"),
    ("tensors", "input_outputs", "ContinuousBatchingIOs", "prepare_batch_tensors"),
    ("compute", "model_runner", "ModelRunner", "compute_batch"),
    ("wait", "input_outputs", "ContinuousBatchingIOs", "retrieve_device_outputs"),
    ("update", "continuous_api", "ContinuousBatchProcessor", "update_batch"),
    ("body", "continuous_api", "ContinuousBatchingManager", "_generation_loop_body"),
)
_CANARY = ("tap_capture_us", "tap_translate_us", "tap_launch_us", "tap_host_step_us", "mirror_us", "setup_us")


@contextlib.contextmanager
def phase_clocks() -> Iterator[collections.Counter[str]]:
    """Each phase's nanoseconds, its methods wrapped outermost (after the canary's own patches)."""
    ns: collections.Counter[str] = collections.Counter()
    pieces = [
        (key, getattr(importlib.import_module(f"{_CB}.{module}"), owner), method)
        for key, module, owner, method in _TIMED
    ]
    with probe_args.clocks(ns, pieces):
        yield ns


@contextlib.contextmanager
def engine_compute_clock(ns: collections.Counter[str]) -> Iterator[None]:
    """``ModelRunner.compute_batch`` timed as the engine's own (entered before the canary's install wraps it)."""
    with probe_args.clocks(
        ns, [("engine_compute", importlib.import_module(f"{_CB}.model_runner").ModelRunner, "compute_batch")]
    ):
        yield


def one_run(model: Any, prompts: list[list[int]], opts: demo.DemoOptions, canary: bool) -> dict[str, float]:
    from kvcanary.adapters.transformers_cb import install

    collected = [g["collections"] for g in gc.get_stats()]
    inner: collections.Counter[str] = collections.Counter()
    with (
        engine_compute_clock(inner),
        install(model, CanaryConfig(mode=Mode.LOG if canary else Mode.OFF)) as c,
        phase_clocks() as ns,
    ):
        start = time.perf_counter_ns()
        demo.generate_waves(model, prompts, opts)
        total = time.perf_counter_ns() - start
    collected = [g["collections"] - b for g, b in zip(gc.get_stats(), collected, strict=True)]
    stats = c.stats() if canary else {}
    steps = ns["compute_calls"]
    ms = 1e-6 / steps
    parts = {k: ns[k] * ms for k in ("offload", "restore", "tensors", "compute", "wait", "update")}
    parts["engine compute"] = inner["engine_compute"] * ms
    parts["schedule"] = ns["next_batch"] * ms - parts["offload"] - parts["restore"] - parts["tensors"]
    phases = ns["next_batch"] + ns["compute"] + ns["wait"] + ns["update"]
    parts["loop other"] = (ns["body"] - phases) * ms
    parts["outside"] = (total - ns["body"]) * ms
    parts["total"] = total * ms
    parts["steps"] = steps
    for gen, n in enumerate(collected):
        parts[f"gc gen{gen} collections"] = n
    for key in ("offload", "restore", "update"):
        parts[f"{key} calls"] = ns[key + "_calls"]
    for key in _CANARY:
        parts[f"canary {key[:-3]}"] = stats.get(key, 0) / 1000 / steps
    return parts


def main() -> None:
    p = probe_args.demo_parser(__doc__.splitlines()[0], default_model="hybrid")
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--gc-freeze", action="store_true", help="gc.freeze() after the warm-up (full collections cheap)")
    args = p.parse_args()
    opts = probe_args.options_of(args)
    model, prompts = demo.workload(opts)
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}

    def run(side: bool) -> float:
        runs[side].append(one_run(model, prompts, opts, side))
        return runs[side][-1]["total"]

    with demo.quiet_engine_logs():
        for side in (False, True):  # warm-up: kernels, allocator, the canary's compilations
            one_run(model, prompts, opts, side)
        if args.gc_freeze:
            gc.collect()
            gc.freeze()
        time_share(lambda _: (run(True), 0), lambda: run(False), args.pairs)  # the demo's alternating pairs
    keys = list(runs[True][0])
    frozen = ", gc frozen after the warm-up" if args.gc_freeze else ""
    steps = runs[True][0]["steps"]
    print(f"model {args.model}{frozen}, {args.pairs} pairs, ms per step (median over runs); steps {steps}")
    print(f"{'phase':<24}{'off':>9}{'on':>9}{'on - off':>10}")
    for k in keys:
        off, on = (statistics.median(r[k] for r in runs[s]) for s in (False, True))
        print(f"{k:<24}{off:>9.3f}{on:>9.3f}{on - off:>10.3f}")
    pairs = zip(runs[False], runs[True], strict=True)
    print("totals per pair (off, on), ms a step:", [(round(a["total"], 3), round(b["total"], 3)) for a, b in pairs])


if __name__ == "__main__":
    main()
