"""Where each cache's set-up goes on the GPU demo: the host time of each piece of ``Binding.create``, per run.

The demo's "each cache's set-up" (the adapter's ``setup_us``) is one ``Binding.create`` a run: tables, record stores,
the staging and its pinned slots, the manager, its pump and step graphs.  Here each of those pieces is wrapped with a
clock (nested pieces are counted in their parents too) and the demo's clean workload runs ``--runs`` times; the
milliseconds of each piece are printed per run.  A few bare allocations (pinned and device) are timed beside it.

Usage: PYTHONPATH=src python scripts/gpu/setup_costs.py [--model hybrid] [--runs 3]
"""

from __future__ import annotations

import collections
import importlib
import sys
import time
from typing import Any

import probe_args
import torch

from kvcanary import demo

# (module, attribute path) of each timed piece.
PIECES = (
    ("kvcanary.adapters.transformers_cb.binding", "Binding.create"),
    ("kvcanary.adapters.transformers_cb.translate", "StepTranslator.__init__"),
    ("kvcanary.adapters.transformers_cb.staging", "Staging.__init__"),
    ("kvcanary.adapters.transformers_cb.staging", "Staging._allocate_slots"),
    ("kvcanary.adapters.transformers_cb.truth_store", "TruthStore.__init__"),
    ("kvcanary.runtime.manager", "CanaryManager.__init__"),
    ("kvcanary.canary", "GroupCanary.__init__"),
    ("kvcanary.canary", "shared_records"),
    ("kvcanary.runtime.buffers", "StepWork.__init__"),
    ("kvcanary.runtime.pump", "LaggedPump.__init__"),
    ("kvcanary.runtime.step_graphs", "cuda_step_graphs"),
    ("kvcanary.runtime.cuda_calls", "CudaCalls.__init__"),
    ("kvcanary.runtime.cuda_calls", "_loaded_cudart"),
    ("kvcanary.runtime.decode", "StepDecoder.__init__"),
    ("kvcanary.runtime.metrics", "make_registry"),
)


def install_clocks(spent: collections.Counter[str]) -> None:
    """Wrap every piece where it is defined and wherever a kvcanary module imported it by name."""
    for module_name, path in PIECES:
        owner: Any = importlib.import_module(module_name)
        *parents, attr = path.split(".")
        for p in parents:
            owner = getattr(owner, p)
        raw = owner.__dict__[attr]
        if isinstance(raw, classmethod):
            setattr(owner, attr, classmethod(probe_args.timed(raw.__func__, path, spent)))
            continue
        wrapped = probe_args.timed(raw, path, spent)
        setattr(owner, attr, wrapped)
        if not parents:  # a module-level function: also where it was imported by name
            for mod in list(sys.modules.values()):
                if getattr(mod, "__name__", "").startswith("kvcanary") and getattr(mod, attr, None) is raw:
                    setattr(mod, attr, wrapped)


def bare_allocations() -> dict[str, float]:
    """Milliseconds of a few allocations alone (each the median of five, freed in between)."""
    cases = {
        "pinned zeros 4 x 8200 int64": lambda: torch.zeros((4, 8200), dtype=torch.int64, pin_memory=True),
        "pinned empty 256 KiB": lambda: torch.empty(1 << 18, dtype=torch.uint8, pin_memory=True),
        "device zeros 1 MiB": lambda: torch.zeros(1 << 20, dtype=torch.uint8, device="cuda"),
    }
    out = {}
    for name, make in cases.items():
        times = []
        for _ in range(5):
            start = time.perf_counter_ns()
            t = make()
            times.append(time.perf_counter_ns() - start)
            del t
        out[name] = round(sorted(times)[2] / 1e6, 3)
    return out


def main() -> int:
    p = probe_args.demo_parser(__doc__.splitlines()[0], default_model="hybrid")
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    opts = probe_args.options_of(args)
    model, prompts = demo.workload(opts)
    spent: collections.Counter[str] = collections.Counter()
    install_clocks(spent)
    with demo.quiet_engine_logs():
        for run in range(args.runs):
            spent.clear()
            result = demo.run_workload(model, prompts, opts, label=f"run {run}")
            setup = result.stats.get("setup_us", 0) / 1000
            times = sorted(((k, v) for k, v in spent.items() if not k.endswith("_calls")), key=lambda kv: -kv[1])
            pieces = ", ".join(f"{k} {v / 1e6:.2f}" for k, v in times)
            print(f"run {run}: set-up {setup:.2f} ms ({result.stats['steps']} steps); pieces, ms: {pieces}")
    if torch.cuda.is_available():
        print("bare allocations, ms:", bare_allocations())
    return 0


if __name__ == "__main__":
    sys.exit(main())
