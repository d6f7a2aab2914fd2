"""Bytecodes and calls the transformers adapter's host path runs per step, by kind of step (no GPU needed).

The GPU demo's host times move by 10 % between runs of one tree on one machine (``scripts/gpu/phase_probe.py``'s A/B
pairs), more than most changes to the per-step path are worth, so a change is first counted here.  The CPU demo runs
with the translator laid out as on CUDA (static outputs, the one-launch translation, shape classes; its launches run
in Triton's interpreter), and every bytecode and call inside ``StepTranslator.translate`` and the host batch's capture
(``HostBatch.from_future_states``) is counted through ``sys.settrace``.  The translations are split as
``tap_steps.py`` splits them on the GPU: full steps (the first of a shape class), steady steps where a request joined
the batch, and steady steps of the same requests.  The counts repeat exactly from run to run; in a serving loop each
of these steps runs with the CPU caches cold, where its cost grows with what it touches.

Writes ``{"scenario": "<model>_<kind>", "steps", "bytecodes", "python_calls", "c_calls"}`` records (per step) into
``<out>/cpu-dry-run-<commit>-bytecodes.json`` when ``--out`` is given (through ``bench_common.save_records``).

Usage: TRITON_INTERPRET=1 PYTHONPATH=src:benchmarks python benchmarks/step_bytecodes.py [--models dense,hybrid]
       [--commit <sha>] [--out DIR]   (about 20 s a model)
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import sys
from collections.abc import Callable
from typing import Any

KINDS = ("same", "join", "full", "capture")
MEASURES = ("bytecodes", "python_calls", "c_calls")


class Counts:
    """Bytecodes, Python calls and C calls run inside the wrapped functions, summed by kind of step."""

    def __init__(self) -> None:
        self.now: collections.Counter[str] = collections.Counter()
        self.by_kind: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.steps: collections.Counter[str] = collections.Counter()

    def _trace(self, frame: Any, event: str, arg: Any) -> Callable[..., Any]:
        frame.f_trace_opcodes = True
        if event == "opcode":
            self.now["bytecodes"] += 1
        elif event == "call":
            self.now["python_calls"] += 1
        return self._trace

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "c_call":
            self.now["c_calls"] += 1

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, collections.Counter[str]]:
        """``fn(*args, **kwargs)`` counted: its result and what it ran."""
        before = self.now.copy()
        sys.settrace(self._trace)
        sys.setprofile(self._profile)
        try:
            out = fn(*args, **kwargs)
        finally:
            sys.settrace(None)
            sys.setprofile(None)
        return out, self.now - before

    def add(self, kind: str, ran: collections.Counter[str]) -> None:
        self.by_kind[kind].update(ran)
        self.steps[kind] += 1


def count_model(model_kind: str) -> list[dict[str, object]]:
    """One CPU demo run of ``model_kind`` with the CUDA layout, counted; a record per kind of step."""
    from kvcanary import demo
    from kvcanary.adapters.transformers_cb import binding, host_batch, install
    from kvcanary.adapters.transformers_cb.translate import StepTranslator
    from kvcanary.config import CanaryConfig, Mode

    counts, previous = Counts(), [()]
    translate, capture = StepTranslator.translate, host_batch.HostBatch.from_future_states.__func__

    def counted_translate(self: StepTranslator, kwargs: Any, host: Any, *, defer: bool = False) -> Any:
        steady = self.steady_steps
        out, ran = counts.run(translate, self, kwargs, host, defer=defer)
        joined = bool(set(host.request_ids) - set(previous[0]))
        previous[0] = host.request_ids
        counts.add("full" if self.steady_steps == steady else "join" if joined else "same", ran)
        return out

    def counted_capture(cls: Any, future_states: Any) -> Any:
        out, ran = counts.run(capture, cls, future_states)
        counts.add("capture", ran)
        return out

    cuda_layout = functools.partial(StepTranslator, static=True, kernel=True, bucket=True)
    patches = [
        (binding, "StepTranslator", cuda_layout),
        (StepTranslator, "translate", counted_translate),
        (host_batch.HostBatch, "from_future_states", classmethod(counted_capture)),
    ]
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        options = demo.DemoOptions(model=model_kind)
        model, prompts = demo.workload(options)
        with install(model, CanaryConfig(mode=Mode.LOG)) as canary:
            demo.generate_waves(model, prompts, options)
            violations = canary.stats()["violations"]
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
    if violations:
        raise SystemExit(f"{model_kind}: the clean run reported {violations} violations")
    return [
        {"scenario": f"{model_kind}_{kind}", "steps": counts.steps[kind]}
        | {m: round(counts.by_kind[kind][m] / counts.steps[kind], 1) for m in MEASURES}
        for kind in KINDS
        if counts.steps[kind]
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="dense,hybrid", help="demo models, comma-separated")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", default=None, help="store the records here as cpu-dry-run-<commit>-bytecodes.json")
    args = p.parse_args()
    records = []
    for model_kind in args.models.split(","):
        print(f"{model_kind}: one counted CPU demo run...", file=sys.stderr, flush=True)
        for record in count_model(model_kind):
            records.append(record)
            print(json.dumps(record), flush=True)
    if args.out is not None:
        import torch

        from bench_common import meta, save_records

        save_records(args.out, meta(args.commit, torch.device("cpu")), args.commit, "-bytecodes.json", records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
