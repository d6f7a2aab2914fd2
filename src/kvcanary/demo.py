"""``kvcanary demo``: the canary on a real paged-KV engine, a clean run and a faulted one.

The engine is HF transformers continuous batching (``generate_batch``) on a tiny random-weight model
built in code (no download).  The workload is sized to exercise the engine's block reuse: 64 prompts
of mixed lengths, many sharing a prefix (prefix hits, cached blocks, in-place de-duplication), two
sampled sequences per prompt (forks copy blocks), a cache small enough that requests are offloaded to
the CPU swap pool and restored, and, for the sliding-window models, sequences longer than the window
(the ring wraps around).  A follow-up wave of 8 prompts then runs on the same engine, whose cache
still holds the first wave's prefix blocks (reused from the ledger's cached blocks).  The clean run
must raise no violation; the rerun injects one fault of the transformers fault library (the self-test's,
:mod:`kvcanary.adapters.transformers_cb.selftest`; by default a read index pointed at another request's
block) and must be caught, with the affected request named.

Prefix sharing is impossible for the hybrid and sliding models: transformers turns it off whenever a
sliding-window group exists, so their runs show no prefix hits, cached reuse or de-duplication.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

import torch

from kvcanary.adapters.transformers_cb.selftest.workload import (
    MODEL_KINDS,
    build_model,
    build_prompts,
    engine_configs,
    quiet_engine_logs,
)
from kvcanary.adapters.transformers_cb.step_clock import StepClock
from kvcanary.config import CanaryConfig, DigestConfig, Mode
from kvcanary.demo_timing import ROUNDS, ShareTiming, time_share
from kvcanary.ops import Backend
from kvcanary.runtime import StepReport
from kvcanary.selftest.protocol import Injection

# The fault each model gets unless --fault names another: a read index pointed at another request's block,
# or, on the model with sliding layers only, a ring read one slot off.
DEFAULT_FAULTS = {
    "dense": "slot-mapping-foreign",
    "hybrid": "slot-mapping-foreign",
    "sliding": "window-ring-off-by-one",
}
DEFAULT_FAULT = DEFAULT_FAULTS["dense"]
_PROGRESS_EVERY = 100
FOLLOW_UP = 8  # prompts of the follow-up wave (after the main wave of DemoOptions.requests prompts)
WARM_UP = 8  # prompts of the canary's warm-up run before a timed comparison (--baseline)


@dataclasses.dataclass(frozen=True)
class DemoOptions:
    model: str = "dense"
    fault: str | None = None  # a fault of the transformers fault library; None: the model's DEFAULT_FAULTS entry
    fault_after_step: int = 30
    requests: int = 64
    follow_up: int = FOLLOW_UP  # prompts of the second wave
    new_tokens: int = 24
    seed: int = 0
    device: str = "cpu"
    backend: Backend = Backend.AUTO
    baseline: bool = False  # also time the workload without the canary (the canary's share of step time)
    rounds: int = ROUNDS  # with baseline: pairs of timed runs (the engine's run time varies more than the canary costs)
    async_batching: bool = False  # the engine's asynchronous batching (CUDA only)
    cuda_graphs: bool = False  # the engine's CUDA graphs (padded batches, warm-up forwards; CUDA only)
    digest_budget: float | None = None  # the KV digest at this budget (design.md §12); None: off
    queue_moves: bool = True  # the adapter's option: the engine's block moves queued for the step work (CUDA)

    def __post_init__(self) -> None:
        from kvcanary.adapters.transformers_cb.selftest import FAULTS

        if self.model not in MODEL_KINDS:
            raise ValueError(f"model must be one of {', '.join(MODEL_KINDS)}, got {self.model!r}")
        if self.fault is None:
            object.__setattr__(self, "fault", DEFAULT_FAULTS[self.model])
        if self.fault not in FAULTS:
            raise ValueError(f"fault must be one of {', '.join(FAULTS)}, got {self.fault!r}")
        if self.requests < 1 or self.new_tokens < 2 or self.follow_up < 0:
            raise ValueError(
                f"need requests >= 1, follow_up >= 0 and new_tokens >= 2, got {self.requests}, {self.follow_up} "
                f"and {self.new_tokens}"
            )
        if self.rounds < 1 or (self.rounds != ROUNDS and not self.baseline):
            raise ValueError(f"rounds (pairs of timed runs) needs baseline and must be >= 1, got {self.rounds}")
        if self.digest_budget is not None:
            DigestConfig(self.digest_budget)  # a budget outside (0, 1] is refused here, before any run


@dataclasses.dataclass
class RunResult:
    stats: dict[str, int]
    features: dict[str, int]
    seconds: float
    outputs: int
    reports: list[StepReport]
    first_detection_step: int | None = None
    injected: Injection | None = None
    step_seconds: float | None = None  # the engine's steps only (:class:`StepClock`); None where not timed
    step_durations: tuple[float, ...] = ()  # each of the engine's steps' seconds, in order (() where not timed)
    step_cpu_seconds: float | None = None  # the loop thread's CPU time in those steps (None where not timed)

    @property
    def timed_seconds(self) -> float:
        return compared_seconds(self.seconds, self.step_seconds)

    def first_report(self) -> StepReport | None:
        """The first report naming a corrupted request, at or after the injection."""
        inj = self.injected
        if inj is None:
            return None
        victims = set(inj.requests)
        return next((r for r in self.reports if r.step >= inj.step and victims & set(r.affected_request_ids)), None)

    @property
    def injected_request(self) -> str | None:
        """The first request the fault corrupted."""
        return None if self.injected is None or not self.injected.requests else self.injected.requests[0]

    @property
    def detected(self) -> bool:
        """The fault was injected and a report at or after its step names a corrupted request."""
        return self.first_report() is not None


@dataclasses.dataclass
class DemoResult:
    options: DemoOptions
    engine: str
    clean: RunResult
    faulted: RunResult
    timing: ShareTiming | None = None  # --baseline: the runs timed with and without the canary
    timed_violations: int = 0  # raised by the timed canary runs after the first (each a clean run too)
    timed_stats: tuple[dict[str, int], ...] = ()  # every timed canary run's stats, the clean run first

    @property
    def passed(self) -> bool:
        clean = self.clean.stats["violations"] == 0 and self.timed_violations == 0
        return clean and self.clean.stats["steps"] > 0 and self.faulted.detected

    def as_json(self) -> dict[str, Any]:
        inj = self.faulted.injected
        first = self.faulted.first_report()
        return {
            "passed": self.passed,
            "engine": {"name": "transformers", "version": self.engine},
            "clean": {k: self.clean.stats[k] for k in ("steps", "verified_slots", "violations")},
            "faulted": {
                "fault": self.options.fault,
                "injected_step": None if inj is None else inj.step,
                "injected_request": self.faulted.injected_request,
                "detected": self.faulted.detected,
                "first_detection_step": self.faulted.first_detection_step,
                "violations": self.faulted.stats["violations"],
                "first_report": None if first is None else {"step": first.step, "lines": first.lines()},
            },
        }


# ---------------------------------------------------------------------------- runs


def generate_batch(model: Any, prompts: list[list[int]], gen: Any, cb: Any, **kwargs: Any) -> dict[str, Any]:
    return dict(model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, **kwargs))


def generate_waves(model: Any, prompts: list[list[int]], options: DemoOptions) -> int:
    """The workload: the main wave, then a follow-up wave on the same (persistent) engine; returns the
    number of sequences generated.  The follow-up starts after every request of the main wave has
    finished, so the blocks of the shared prefixes wait in the ledger's cached blocks and are taken back
    from there -- the cached-block reuse a serving engine sees across batches, independent of how
    the first wave's requests happened to be batched."""
    gen, cb = engine_configs(
        options.model, options.new_tokens, options.seed, options.async_batching, options.cuda_graphs
    )
    main, follow_up = prompts[: options.requests], prompts[options.requests :]
    try:
        n = len(generate_batch(model, main, gen, cb, persistent_manager=True))
        if follow_up:
            n += len(generate_batch(model, follow_up, gen, cb, persistent_manager=True))
    finally:
        model.destroy_cached_continuous_batching_manager()
    return n


def compared_seconds(seconds: float, step_seconds: float | None) -> float:
    """What the share compares of a timed run: the engine's steps' seconds where they were timed, else the run's."""
    return seconds if step_seconds is None else step_seconds


@dataclasses.dataclass(frozen=True)
class TimedRun:
    """What :func:`timed_waves` measured: the sequences, the run's seconds, the engine's steps' seconds (None where
    the step clock is not available), each step's seconds in order (() where not available) and the loop thread's CPU
    time in the steps (None where not available)."""

    outputs: int
    seconds: float
    step_seconds: float | None
    step_durations: tuple[float, ...]
    step_cpu_seconds: float | None = None


def timed_waves(model: Any, prompts: list[list[int]], options: DemoOptions) -> TimedRun:
    """:func:`generate_waves` timed.  The previous run's garbage is collected and its device work finished first,
    so that neither is timed here."""
    gc.collect()
    if torch.device(options.device).type == "cuda":
        torch.cuda.synchronize(options.device)
    with StepClock(keep=True) as clock:
        start = time.perf_counter()
        n = generate_waves(model, prompts, options)
        seconds = time.perf_counter() - start
    if not clock.available:
        return TimedRun(n, seconds, None, ())
    return TimedRun(n, seconds, clock.seconds, tuple(clock.durations or ()), clock.cpu_seconds)


def run_workload(
    model: torch.nn.Module,
    prompts: list[list[int]],
    options: DemoOptions,
    *,
    label: str,
    fault: str | None = None,
    progress: TextIO | None = None,
) -> RunResult:
    """One ``generate_batch`` over the workload with the canary installed (and a fault, if named)."""
    from kvcanary.adapters.transformers_cb import install
    from kvcanary.adapters.transformers_cb.selftest.hooks import FaultHooks, attach_fault

    def on_step(step: int, _: object) -> None:
        if progress is not None and step % _PROGRESS_EVERY == 0:
            s = canary.stats()
            print(
                f"  [{label}] step {step}: {s['verified_slots']:,} slots verified, {s['violations']} violations",
                file=progress,
                flush=True,
            )

    digest = None if options.digest_budget is None else DigestConfig(options.digest_budget)
    config = CanaryConfig(mode=Mode.LOG, digest=digest)
    canary = install(model, config, backend=options.backend, on_step=on_step, queue_moves=options.queue_moves)
    injector: FaultHooks | None = None
    try:
        if fault is not None:
            injector = attach_fault(canary, fault, after_step=options.fault_after_step, seed=options.seed)
        timed = timed_waves(model, prompts, options)
        canary.flush()
        canary.check_effective()
        return RunResult(
            stats=canary.stats(),
            features=canary.features(),
            seconds=timed.seconds,
            outputs=timed.outputs,
            reports=canary.reports,
            first_detection_step=canary.first_report_step,
            injected=None if injector is None else injector.injection,
            step_seconds=timed.step_seconds,
            step_durations=timed.step_durations,
            step_cpu_seconds=timed.step_cpu_seconds,
        )
    finally:
        if injector is not None:
            injector.detach()
        canary.uninstall()


def time_baseline(model: torch.nn.Module, prompts: list[list[int]], options: DemoOptions) -> TimedRun:
    """The workload with the canary off (mode ``off``: hooks installed, no canary work; this also keeps
    the CPU-offload work-around of :mod:`kvcanary.adapters.transformers_cb.cpu_offload`), timed."""
    from kvcanary.adapters.transformers_cb import install

    with install(model, CanaryConfig(mode=Mode.OFF)):
        return timed_waves(model, prompts, options)


def cpu_seconds(
    baselines: Sequence[TimedRun], runs: Sequence[RunResult]
) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """The loop thread's CPU seconds in the steps of each run, without and with the canary (None where any run's
    steps were not timed)."""
    without = tuple(b.step_cpu_seconds for b in baselines if b.step_cpu_seconds is not None)
    with_canary = tuple(r.step_cpu_seconds for r in runs if r.step_cpu_seconds is not None)
    if len(without) != len(baselines) or len(with_canary) != len(runs):
        return None
    return without, with_canary


def workload(options: DemoOptions) -> tuple[Any, list[list[int]]]:
    """The demo's model and its prompts (both waves) for ``options``: what the demo and the GPU probes run."""
    return build_model(options.model, options.seed, options.device), build_prompts(
        options.requests + options.follow_up, options.seed
    )


def run_demo(options: DemoOptions, progress: TextIO | None = sys.stderr) -> DemoResult:
    from kvcanary.adapters.transformers_cb.version import check_version

    engine = check_version()
    model, prompts = workload(options)
    with quiet_engine_logs():
        if not options.baseline:
            clean = run_workload(model, prompts, options, label="clean", progress=progress)
            faulted = run_workload(model, prompts, options, label="faulted", fault=options.fault, progress=progress)
            return DemoResult(options, engine, clean, faulted)
        time_baseline(model, prompts, options)  # warm-up (kernels, allocator)
        # The canary's warm-up too (its kernels compile on first use), so both sides are timed warm.
        warm = dataclasses.replace(options, requests=min(WARM_UP, options.requests), follow_up=0)
        run_workload(model, prompts[: warm.requests], warm, label="warm-up")
        runs: list[RunResult] = []
        baselines: list[TimedRun] = []

        def timed(i: int) -> tuple[float, int]:
            label, shown = ("clean", progress) if i == 0 else (f"timed {i + 1}", None)
            runs.append(run_workload(model, prompts, options, label=label, progress=shown))
            return runs[-1].timed_seconds, runs[-1].stats["violations"]

        def baseline() -> float:
            baselines.append(time_baseline(model, prompts, options))
            return compared_seconds(baselines[-1].seconds, baselines[-1].step_seconds)

        timing, violations = time_share(timed, baseline, options.rounds)
        timing = dataclasses.replace(
            timing,
            walls=(tuple(b.seconds for b in baselines), tuple(r.seconds for r in runs)),
            steps=(tuple(b.step_durations for b in baselines), tuple(r.step_durations for r in runs)),
            cpus=cpu_seconds(baselines, runs),
        )
        faulted = run_workload(model, prompts, options, label="faulted", fault=options.fault, progress=progress)
    return DemoResult(options, engine, runs[0], faulted, timing, sum(violations[1:]), tuple(r.stats for r in runs))
