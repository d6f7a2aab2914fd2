"""Does the engine wait for the canary's device work?  The demo workload traced with the canary off and on (not run
by CI).

The phase probe (``phase_probe.py``) saw the engine's ``compute`` phase run about 0.04 ms a step longer with the
canary on than the canary's own host time inside it, while the engine's explicit wait for the device did not grow.
If the forward blocks on the stream somewhere (a synchronous copy, a ``.item()``), the canary's kernels queued ahead
of it would be waited for there.  This traces one run of each side under torch's profiler (CUDA activity: kernels,
copies and the CUDA runtime calls) and prints, per step: the GPU's kernel and copy time, the canary's own kernels
(by name), the busy time (the union of the intervals), and the host's time in each CUDA runtime call (a call that
blocks, a synchronisation or a synchronous copy, shows its wait there).  The profiler slows the host; the comparison
is between the two sides of one trace each.

Usage: PYTHONPATH=src python scripts/gpu/device_timeline.py [--model dense] [--out DIR]
"""

from __future__ import annotations

import collections
import json
import pathlib
import tempfile
from typing import Any

import torch
from probe_args import demo_options
from torch.profiler import ProfilerActivity, profile

from kvcanary import demo
from kvcanary.config import CanaryConfig, Mode

CANARY_KERNELS = ("plan_kernel", "verify_kernel", "stamp_kernel", "translate_kernel", "truth_scatter", "step_close",
                  "digest_kernel")  # fmt: skip


def traced_run(model: Any, prompts: list[list[int]], opts: demo.DemoOptions, canary: bool) -> tuple[list[dict], int]:
    """One run under the profiler: its trace events and the steps it ran."""
    from kvcanary.adapters.transformers_cb import install

    with install(model, CanaryConfig(mode=Mode.LOG if canary else Mode.OFF)) as c:
        # CUDA activity only (CUPTI sees every thread's kernels and runtime calls; the engine steps in a thread of its
        # own); on the CPU (a dry run of this script) the CPU activity.
        cuda = opts.device == "cuda"
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            demo.generate_waves(model, prompts, opts)
        if cuda:
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = pathlib.Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    return events, c.stats()["steps"] if canary else 0


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def summarise(events: list[dict], steps: int) -> dict[str, float]:
    """Per step: GPU kernel, copy and busy time, the canary's kernels (us, and launches), and the host's time in each
    CUDA runtime call with its count (a blocking one shows its wait there)."""
    out: collections.Counter[str] = collections.Counter()
    busy: list[tuple[float, float]] = []
    for e in events:
        cat, name, dur = e.get("cat", ""), e.get("name", ""), float(e.get("dur", 0) or 0)
        if cat == "kernel":
            out["gpu kernels"] += dur
            out["gpu kernel launches"] += 1
            if any(k in name for k in CANARY_KERNELS):
                out["canary kernels"] += dur
                out["canary kernel launches"] += 1
            busy.append((float(e["ts"]), float(e["ts"]) + dur))
        elif cat in ("gpu_memcpy", "gpu_memset"):
            out["gpu copies"] += dur
            busy.append((float(e["ts"]), float(e["ts"]) + dur))
        elif cat in ("cuda_runtime", "cuda_driver"):
            out["runtime calls"] += 1
            out["runtime call time"] += dur
            out[f"host in {name}"] += dur  # a blocking call (a synchronisation, a synchronous copy) shows here
            out[f"{name} calls"] += 1
    out["gpu busy"] = _union(busy)
    return {k: v / max(steps, 1) for k, v in out.items()}


def main() -> None:
    opts = demo_options(__doc__.splitlines()[0])
    model, prompts = demo.workload(opts)
    with demo.quiet_engine_logs():
        for side in (False, True):  # warm-up: kernels compiled, allocator grown
            traced_run(model, prompts, opts, side)
        on, steps = traced_run(model, prompts, opts, True)
        off, _ = traced_run(model, prompts, opts, False)
    rows = {"off": summarise(off, steps), "on": summarise(on, steps)}
    keys = sorted(set(rows["off"]) | set(rows["on"]))
    print(f"model {opts.model}: {steps} steps, one traced run a side; per step (us, or calls)")
    print(f"{'':<40}{'off':>10}{'on':>10}{'on - off':>10}")
    keys.sort(key=lambda k: (k.endswith(" calls"), -max(rows["off"].get(k, 0.0), rows["on"].get(k, 0.0))))
    for k in keys:
        a, b = rows["off"].get(k, 0.0), rows["on"].get(k, 0.0)
        print(f"{k:<40}{a:>10.2f}{b:>10.2f}{b - a:>10.2f}")


if __name__ == "__main__":
    main()
