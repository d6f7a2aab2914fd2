"""Steady steps of the demo's workloads: how many steps reuse a kept translation, with the transformers adapter's
translator laid out as on CUDA (one launch a group, static buffers, shape classes) on any device.

On the CPU the translation's launches run under Triton's interpreter (``TRITON_INTERPRET=1``), so this counts what
the GPU demo's "steady steps" line counts without a GPU: the same engine, workload and translator code.  Each record
also carries the canary's mean host time per step by phase; on the CPU only ``translate_us`` (the host's own work,
with every cache cold after the interpreter ran) is worth reading, the launch phase is the interpreter's.

Writes ``results/<gpu>-<commit>-steady.json`` ({"meta", "records"}: one record a model).
Usage: TRITON_INTERPRET=1 PYTHONPATH=src:benchmarks python benchmarks/steady_coverage.py --commit <sha>
       [--models dense,hybrid,sliding] [--requests 64] [--device cpu]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

from bench_common import meta, save_records

PHASES = ("capture", "translate", "launch", "host_step")


@contextlib.contextmanager
def cuda_layout() -> Iterator[None]:
    """The adapter's translator built as on CUDA, whatever the device (restored on exit)."""
    from kvcanary.adapters.transformers_cb import binding
    from kvcanary.adapters.transformers_cb.translate import StepTranslator

    original = binding.StepTranslator
    binding.StepTranslator = functools.partial(StepTranslator, static=True, kernel=True, bucket=True)  # type: ignore[misc]
    try:
        yield
    finally:
        binding.StepTranslator = original  # type: ignore[misc]


def measure(model: str, requests: int, device: str) -> dict[str, Any]:
    """One clean run of the demo's workload for ``model``: its steps, steady steps and host time by phase."""
    from kvcanary.demo import FOLLOW_UP, DemoOptions, build_model, build_prompts, quiet_engine_logs, run_workload

    options = DemoOptions(model=model, requests=requests, device=device)
    start = time.perf_counter()
    with quiet_engine_logs(), cuda_layout():
        run = run_workload(build_model(model).to(device), build_prompts(requests + FOLLOW_UP), options, label=model)
    steps = run.stats["steps"]
    return {
        "scenario": f"steady_{model}",
        "steps": steps,
        "steady_steps": run.features["steady_steps"],
        "verified_slots": run.stats["verified_slots"],
        "violations": run.stats["violations"],
        **{f"{p}_us": round(run.stats[f"tap_{p}_us"] / max(steps, 1), 1) for p in PHASES},
        "seconds": round(time.perf_counter() - start, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--models", default="dense,hybrid,sliding")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import transformers

    records = []
    for model in args.models.split(","):
        rec = measure(model, args.requests, args.device)
        print(rec, file=sys.stderr, flush=True)
        records.append(rec)
    m = meta(args.commit, torch.device(args.device)) | {"transformers": transformers.__version__}
    save_records(args.out, m, args.commit, "-steady.json", records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
