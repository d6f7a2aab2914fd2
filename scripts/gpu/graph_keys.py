"""Which parts of the canary's step-graph key change between steps on the GPU demo (why steps run eagerly).

Runs the demo's clean workload on CUDA, records every step's key (the prelude's and the batches') and
whether it replayed, then prints, for the steps that ran eagerly, how many distinct values each key
component took.  Usage: PYTHONPATH=src python scripts/gpu/graph_keys.py [--model dense|hybrid|sliding]
"""

from __future__ import annotations

import argparse
import collections
from typing import Any

from kvcanary import demo
from kvcanary.runtime import step_graphs


def _flatten(key: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(key, tuple | list):
        out: list[tuple[str, Any]] = [(f"{prefix}#len", len(key))]
        for i, k in enumerate(key):
            out.extend(_flatten(k, f"{prefix}.{i}"))
        return out
    return [(prefix, key)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dense", choices=demo.MODEL_KINDS)
    args = p.parse_args()
    log: list[tuple[bool, Any]] = []
    original_replay = step_graphs.StepGraphs.replay

    def replay(self: step_graphs.StepGraphs, key: Any) -> bool:
        hit = original_replay(self, key)
        log.append((hit, key))
        return hit

    step_graphs.StepGraphs.replay = replay  # type: ignore[method-assign]
    opts = demo.DemoOptions(model=args.model, device="cuda")
    model, prompts = demo.workload(opts)
    with demo.quiet_engine_logs():
        demo.run_workload(model, prompts, opts, label="keys")
    eager = [k for hit, k in log if not hit]
    print(f"model {args.model}: {len(log)} keyed steps, {len(eager)} eager, {len(set(eager))} distinct eager keys")
    comps: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for k in eager:
        for name, v in _flatten(k):
            comps[name][repr(v)] += 1
    for name, c in comps.items():
        if len(c) > 1:
            print(f"{name}: {len(c)} values; top: {c.most_common(3)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
