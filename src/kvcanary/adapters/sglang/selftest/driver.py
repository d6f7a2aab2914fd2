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
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from kvcanary.adapters.sglang.selftest.context import AttentionTap, SglangInjector
from kvcanary.adapters.sglang.selftest.faults import FAULTS, WORKLOAD
from kvcanary.adapters.sglang.selftest.scheduler_loop import SchedulerLoop
from kvcanary.adapters.sglang.selftest.workload import WorkloadRequest, run_workload, standard_workload
from kvcanary.selftest.outcome import run_outcome, verdict_settled
from kvcanary.selftest.protocol import EngineDriver, InjectMode, RunOutcome, RunSpec
from kvcanary.selftest.quiet import quiet_loggers
from kvcanary.selftest.read_oracle import ReadOracle

DIGEST_BUDGET = 1.0  # the KV digest checks every read slot's bytes each forward (the byte faults, design.md §12)


class SglangDriver(EngineDriver):
    """The self-test of the sglang adapter on sglang's own scheduling loop."""

    name = "sglang"
    faults = FAULTS
    workloads = (WORKLOAD,)
    version_module = "kvcanary.adapters.sglang.version"
    needs = "the sglang self-test needs a supported sglang"
    title = "sglang {version} scheduler loop (CPU, torch-native attention, tiny Llama)"

    def __init__(self) -> None:
        self.loop: SchedulerLoop | None = None

    @contextlib.contextmanager
    def session(self, kinds: Sequence[str]) -> Iterator[None]:
        # The self-test prints its own matrix: silence the canary's log lines and sglang's (retractions).
        with quiet_loggers("kvcanary", "sglang"):
            if self.loop is None:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # sglang's import-time notices about CUDA-only kernels
                    self.loop = SchedulerLoop()
            yield
            self.loop.reset()

    def run(self, spec: RunSpec) -> RunOutcome:
        if spec.kind != WORKLOAD:
            raise ValueError(f"unknown workload {spec.kind!r}; the sglang driver runs {WORKLOAD!r}")
        if self.loop is None:
            raise RuntimeError("SglangDriver.run outside session()")
        return run_once(self.loop, standard_workload(spec.seed), spec)


def run_once(loop: SchedulerLoop, requests: list[WorkloadRequest], spec: RunSpec) -> RunOutcome:
    """One run of ``requests`` with ``spec.faults`` placed (probe: the clean control; inject: at ``spec.target``)."""
    oracle = ReadOracle(spec.store, int(loop.runner.model_config.num_hidden_layers))
    loop.reset()
    canary = loop.install("log", kv_canary_digest_budget=DIGEST_BUDGET)
    ctx = SglangInjector(loop, spec.mode, rng=spec.rng(), target=spec.target)
    tap = AttentionTap(loop, oracle, ctx)
    for fault in spec.faults:
        fault.install(ctx)
    reports: list[Any] = []
    errors: list[str] = []
    stopped: list[bool] = []

    def after_step(loop_: SchedulerLoop, iteration: int) -> None:
        _keep(reports, canary.last_report)
        ctx.after_step(loop_, iteration)

    def settled() -> bool:
        if spec.mode is InjectMode.INJECT and _settled(ctx, oracle, reports, loop.forwards_started):
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
    return verdict_settled(ctx, oracle, done, (r.step for r in reports))
