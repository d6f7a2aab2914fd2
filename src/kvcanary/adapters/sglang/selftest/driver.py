"""The sglang self-test driver (:class:`SglangDriver`, an :class:`~kvcanary.selftest.protocol.EngineDriver`).

One run = :func:`~.workload.run_workload` through sglang's own in-process scheduler
(:mod:`.scheduler_loop`) with the canary installed in ``log`` mode, the faults' hooks placed on the loop and
the read oracle tapped into sglang's torch-native attention (:mod:`.context`).  sglang builds its process
groups once per process, so a session builds one scheduler and every run starts with ``reset()``.

A faulted run stops once its verdict cannot change: detection and the first affected read both known, or
a few more forwards after either (the same rule as the transformers driver).
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from kvcanary.adapters.sglang.selftest.context import AttentionTap, SglangInjector
from kvcanary.adapters.sglang.selftest.faults import FAULTS, WORKLOAD
from kvcanary.adapters.sglang.selftest.scheduler_loop import SchedulerLoop
from kvcanary.adapters.sglang.selftest.workload import WorkloadRequest, run_workload, standard_workload
from kvcanary.selftest.outcome import run_outcome, verdict_settled
from kvcanary.selftest.protocol import Fault, InjectMode, RunOutcome, engine_version
from kvcanary.selftest.read_oracle import ReadOracle

_GRACE_FORWARDS = 3
_QUIET_LOGGERS = ("kvcanary", "sglang")  # a faulted run stops this many forwards after its verdict is known
DIGEST_BUDGET = 1.0  # the KV digest checks every read slot's bytes each forward (the byte faults, design.md §12)


class SglangDriver:
    """The self-test of the sglang adapter on sglang's own scheduling loop."""

    name = "sglang"
    faults = FAULTS
    workloads = (WORKLOAD,)

    def __init__(self) -> None:
        self.loop: SchedulerLoop | None = None

    def check(self) -> str:
        from kvcanary.adapters.sglang.version import check_version

        return engine_version(check_version, "the sglang self-test needs a supported sglang")

    def describe(self, version: str) -> str:
        return f"sglang {version} scheduler loop (CPU, torch-native attention, tiny Llama)"

    @contextlib.contextmanager
    def session(self, kinds: Sequence[str]) -> Iterator[None]:
        # The self-test prints its own matrix: silence the canary's log lines and sglang's (retractions).
        levels = {name: logging.getLogger(name).level for name in _QUIET_LOGGERS}
        try:
            for name in _QUIET_LOGGERS:
                logging.getLogger(name).setLevel(logging.ERROR)
            if self.loop is None:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # sglang's import-time notices about CUDA-only kernels
                    self.loop = SchedulerLoop()
            yield
            self.loop.reset()
        finally:
            for name, level in levels.items():
                logging.getLogger(name).setLevel(level)

    def run(
        self,
        kind: str,
        seed: int,
        faults: Sequence[Fault[Any]],
        *,
        mode: InjectMode,
        target: tuple[str, int] | None = None,
        store: object = None,
    ) -> RunOutcome:
        if kind != WORKLOAD:
            raise ValueError(f"unknown workload {kind!r}; the sglang driver runs {WORKLOAD!r}")
        if self.loop is None:
            raise RuntimeError("SglangDriver.run outside session()")
        return run_once(self.loop, standard_workload(seed), seed, faults, mode=mode, target=target, store=store)


def run_once(
    loop: SchedulerLoop,
    requests: list[WorkloadRequest],
    seed: int,
    faults: Sequence[Fault[Any]],
    *,
    mode: InjectMode,
    target: tuple[str, int] | None = None,
    store: object = None,
) -> RunOutcome:
    """One run of ``requests`` with ``faults`` placed (probe: the clean control; inject: at ``target``)."""
    if store is not None and not isinstance(store, dict):
        raise TypeError(f"store must be the reference a probe run returned, got {type(store).__name__}")
    loop.reset()
    canary = loop.install("log", kv_canary_digest_budget=DIGEST_BUDGET)
    ctx = SglangInjector(loop, mode, rng=random.Random(f"{seed}:{target}"), target=target)
    oracle = ReadOracle(store, int(loop.runner.model_config.num_hidden_layers))
    tap = AttentionTap(loop, oracle, ctx)
    for fault in faults:
        fault.install(ctx)
    reports: list[Any] = []
    errors: list[str] = []
    stopped: list[bool] = []

    def after_step(loop_: SchedulerLoop, iteration: int) -> None:
        _keep(reports, canary.last_report)
        ctx.after_step(loop_, iteration)

    def settled() -> bool:
        if mode is InjectMode.INJECT and _settled(ctx, oracle, reports, loop.forwards_started):
            stopped.append(True)
        return bool(stopped)

    tap.attach()
    start = time.perf_counter()
    try:
        run_workload(loop, requests, before_forward=ctx.before_forward, after_step=after_step, stop=settled)
    except Exception as exc:  # sglang failing under a corrupted state is an outcome, not a crash of the run
        errors.append(f"engine: {type(exc).__name__}: {exc}")
    finally:
        tap.detach()
        ctx.patches.restore()  # the faults' wraps on engine objects (the pool's set_kv_buffer)
    seconds = time.perf_counter() - start
    if not loop.in_forward and not errors:
        _keep(reports, canary.flush())
    stats, features = canary.stats(), {**dict(loop.features), **canary.features()}
    loop.reset()
    return run_outcome(
        ctx, oracle, stats=stats, features=features, reports=sorted(reports, key=lambda r: r.step),
        seconds=seconds, errors=errors, stopped_early=bool(stopped),
    )  # fmt: skip


def _keep(reports: list[Any], report: Any) -> None:
    if report is not None and all(r.step != report.step for r in reports):
        reports.append(report)


def _settled(ctx: SglangInjector, oracle: ReadOracle, reports: list[Any], forwards: int) -> bool:
    done = forwards - 1  # the last forward run; its report arrives with the next host step
    return verdict_settled(ctx, oracle, done, (r.step for r in reports), _GRACE_FORWARDS)
