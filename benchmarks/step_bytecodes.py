"""Bytecodes and calls the transformers adapter's host path runs per step, by kind of step (no GPU needed).

The GPU demo's host times move by 10 % between runs of one tree on one machine (``scripts/gpu/phase_probe.py``'s A/B
pairs), more than most changes to the per-step path are worth, so a change is first counted here.  The CPU demo runs
with the translator laid out as on CUDA (static outputs, the one-launch translation, shape classes; its launches run
in Triton's interpreter), and every bytecode and call inside ``StepTranslator.translate`` and the host batch's capture
(``HostBatch.from_future_states``) is counted through ``sys.settrace``.  The translations are split as
``tap_steps.py`` splits them on the GPU: full steps (the first of a shape class), steady steps where a request joined
the batch, and steady steps of the same requests.  The counts repeat exactly from run to run; in a serving loop each
of these steps runs with the CPU caches cold, where its cost grows with what it touches.

``--cold`` times the same calls instead, each with the CPU caches flushed just before it (a buffer larger than the
last-level cache written through), as a serving loop's engine leaves them: the median microseconds of each kind of
step, and of the pieces of the steady translation (``PIECES``) inside it.  Bytecodes say what a change removes; the
cold times say whether what it touched was what cost.

Writes ``{"scenario": "<model>_<kind>", "steps", "bytecodes", "python_calls", "c_calls"}`` records (per step) into
``<out>/cpu-dry-run-<commit>-bytecodes.json`` when ``--out`` is given (through ``bench_common.save_records``); with
``--cold``, ``{"scenario", "steps", "cold_us"}`` records (and ``<piece>_us``) into ``...-cold.json``.

Usage: TRITON_INTERPRET=1 PYTHONPATH=src:benchmarks python benchmarks/step_bytecodes.py [--models dense,hybrid]
       [--cold] [--commit <sha>] [--out DIR]   (about 20 s a model; 40 s cold)
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

KINDS = ("same", "join", "full", "capture")
MEASURES = ("bytecodes", "python_calls", "c_calls")
# The steady translation's pieces timed with --cold: (module, owner or None for a function, name).
PIECES = (
    ("kvcanary.adapters.transformers_cb.translate", None, "engine_reading"),  # as translate imported it
    ("kvcanary.adapters.transformers_cb.steady_step", "KeptSteps", "find"),
    ("kvcanary.adapters.transformers_cb.truth_store", "TruthStore", "plan"),
    ("kvcanary.adapters.transformers_cb.steady_region", "StagedRegion", "send"),
    ("kvcanary.adapters.transformers_cb.staging", "Staging", "send_at"),
)
FLUSH_BYTES = 256 << 20  # written through before each timed call: larger than any last-level cache here


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


class ColdTimes:
    """The same interface as :class:`Counts`, timing each call with the caches flushed just before it: per kind of
    step, the call's microseconds and those of each piece (``PIECES``) it ran."""

    def __init__(self) -> None:
        self._flush = np.zeros(FLUSH_BYTES, dtype=np.uint8)
        self.now: collections.Counter[str] = collections.Counter()  # the pieces' ns inside the current call
        self.by_kind: dict[str, list[collections.Counter[str]]] = collections.defaultdict(list)

    def piece(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.now[name] += time.perf_counter_ns() - start

        return timed

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, collections.Counter[str]]:
        """``fn(*args, **kwargs)`` timed, the caches flushed first: its result, and its time and its pieces'."""
        self._flush += 1
        self.now = collections.Counter()
        start = time.perf_counter_ns()
        out = fn(*args, **kwargs)
        self.now["cold"] += time.perf_counter_ns() - start
        return out, self.now

    def add(self, kind: str, ran: collections.Counter[str]) -> None:
        self.by_kind[kind].append(ran)

    def records(self, model_kind: str) -> list[dict[str, object]]:
        """Per kind of step: the median microseconds of the call and of each piece it ran."""
        out: list[dict[str, object]] = []
        for kind in KINDS:
            runs = self.by_kind.get(kind)
            if runs:
                names = ["cold"] + [p[2] for p in PIECES if any(p[2] in r for r in runs)]
                medians = {f"{n}_us": round(statistics.median(r[n] for r in runs) / 1000, 1) for n in names}
                out.append({"scenario": f"{model_kind}_{kind}", "steps": len(runs)} | medians)
        return out


def _piece_patches(times: ColdTimes) -> list[tuple[Any, str, Any]]:
    """Each of ``PIECES`` wrapped in a timer of ``times``, as (owner, name, wrapper)."""
    patches: list[tuple[Any, str, Any]] = []
    for module_name, owner_name, name in PIECES:
        module = importlib.import_module(module_name)
        owner = module if owner_name is None else getattr(module, owner_name)
        patches.append((owner, name, times.piece(name, owner.__dict__[name])))
    return patches


def count_model(model_kind: str, cold: bool = False) -> list[dict[str, object]]:
    """One CPU demo run of ``model_kind`` with the CUDA layout, counted (``cold``: timed cold instead); a record per
    kind of step."""
    from kvcanary import demo
    from kvcanary.adapters.transformers_cb import binding, host_batch, install
    from kvcanary.adapters.transformers_cb.translate import StepTranslator
    from kvcanary.config import CanaryConfig, Mode

    counts: Counts | ColdTimes = ColdTimes() if cold else Counts()
    previous: list[tuple[str, ...]] = [()]
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
    if isinstance(counts, ColdTimes):
        patches += _piece_patches(counts)
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
    if isinstance(counts, ColdTimes):
        return counts.records(model_kind)
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
    p.add_argument("--cold", action="store_true", help="time each call with the caches flushed before it")
    p.add_argument("--out", default=None, help="store the records here as cpu-dry-run-<commit>-bytecodes.json")
    args = p.parse_args()
    records = []
    for model_kind in args.models.split(","):
        print(f"{model_kind}: one {'timed' if args.cold else 'counted'} CPU demo run...", file=sys.stderr, flush=True)
        for record in count_model(model_kind, args.cold):
            records.append(record)
            print(json.dumps(record), flush=True)
    if args.out is not None:
        import torch

        from bench_common import meta, save_records

        suffix = "-cold.json" if args.cold else "-bytecodes.json"
        save_records(args.out, meta(args.commit, torch.device("cpu")), args.commit, suffix, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
