"""``kvcanary soak``: a long randomized clean workload on a real engine, checked for silence and steadiness.

Engine-neutral: the options, the per-step clock, the verdict and the summary.  Each engine's workload lives
with its adapter, in the module :data:`SOAK_ENGINES` names, which exposes ``engine_version() -> str`` and
``run_phase(model, steps, options, out) -> PhaseResult``: requests arrive, finish and are cancelled (about
one in :data:`CANCEL_EVERY`) continuously on the real engine, with every feature it has, and the phase
feeds a :class:`PhaseProgress` once per canary step.

The verdict (exit 0) needs, in every phase: no violation, no health failure, no adapter error, and a
steady state after warm-up (the first :data:`WARM_UP_SHARE` of the phase's steps, and at least
:data:`WARM_UP_MIN_STEPS` or half of a shorter phase):

* host RSS at the end <= RSS after warm-up x (1 + :data:`RSS_GROWTH`) + :data:`RSS_SLACK_BYTES`;
* the median canary host time per step over the last :data:`WINDOW_SHARE` of the steps <=
  :data:`TIME_GROWTH` x the median over the first such window after warm-up, or, if not, the median
  share of each step's wall time spent in the canary did not grow by that factor either (so load from
  other processes on a shared host, which stretches the canary and the engine alike, is not a failure).
"""

from __future__ import annotations

import dataclasses
import importlib
import random
import statistics
import sys
import time
import types
from collections.abc import Callable
from typing import Any, TextIO

import torch

from kvcanary.ops import Backend


@dataclasses.dataclass(frozen=True)
class SoakEngine:
    module: str  # exposes engine_version() and run_phase(model, steps, options, out)
    phases: tuple[str, ...]  # the models it can run, the default all of them, one after the other
    needs: str  # what to install, for the refusal when it cannot run (with where to read how, in parentheses)


SOAK_ENGINES: types.MappingProxyType[str, SoakEngine] = types.MappingProxyType(
    {
        "transformers": SoakEngine(
            "kvcanary.adapters.transformers_cb.soak", ("dense", "hybrid"), "transformers 5.24.0 and psutil"
        ),
        "sglang": SoakEngine(
            "kvcanary.adapters.sglang.soak", ("dense",), "sglang 0.5.23 and psutil (a venv of its own: docs/sglang.md)"
        ),
        "vllm": SoakEngine(
            "kvcanary.adapters.vllm.soak", ("dense",), "vLLM 0.32.0 and psutil (a venv of its own: docs/vllm.md)"
        ),
    }
)
WARM_UP_SHARE = 0.1  # of a phase's steps: kernel compilation, allocator growth, caches filling
WARM_UP_MIN_STEPS = 200  # a short phase's 10 % ends before the engine's pools and caches have filled
WINDOW_SHARE = 0.1  # of a phase's steps: the start and end windows of the per-step time
RSS_GROWTH = 0.02
RSS_SLACK_BYTES = 16 << 20  # allocator granularity and Python's free lists, not per-request growth
TIME_GROWTH = 1.5
CANCEL_EVERY = 12
_PROGRESS_EVERY = 1000


@dataclasses.dataclass(frozen=True)
class SoakOptions:
    steps: int = 5000
    seed: int = 0
    device: str = "cpu"
    backend: Backend = Backend.AUTO
    models: tuple[str, ...] = ()  # () = every phase the engine has
    engine: str = "transformers"

    def __post_init__(self) -> None:
        if self.engine not in SOAK_ENGINES:
            raise ValueError(f"--engine takes one of {', '.join(SOAK_ENGINES)}, got {self.engine!r}")
        phases = SOAK_ENGINES[self.engine].phases
        if not self.models:
            object.__setattr__(self, "models", phases)
        unknown = [m for m in self.models if m not in phases]
        if unknown or len(set(self.models)) != len(self.models):
            names = ", ".join(phases)
            raise ValueError(f"--models takes distinct names from {names}, got {','.join(self.models)!r}")
        if self.steps < 20 * len(self.models):
            raise ValueError(f"--steps must be at least {20 * len(self.models)}, got {self.steps}")


@dataclasses.dataclass
class Traffic:
    """The requests a soak keeps in flight, topped up to a random count in [low, high] before each engine step;
    about one in :data:`CANCEL_EVERY` is cancelled as it arrives (a cancelled request delivers no final result).
    ``submit(rid, prompt)`` and ``cancel(rid)`` are the engine's own calls; the engine's loop discards the
    requests that finish."""

    low: int
    high: int
    chunk: int  # prompt tokens a step prefills: longer prompts are chunked
    requests: int = 0
    cancelled: int = 0
    chunked: int = 0  # prompts longer than ``chunk``
    in_flight: set[str] = dataclasses.field(default_factory=set)

    def top_up(
        self, rng: random.Random, prompts: list[list[int]], submit: Callable[[str, list[int]], None],
        cancel: Callable[[str], None],
    ) -> None:  # fmt: skip
        while len(self.in_flight) < rng.randint(self.low, self.high):
            rid, prompt = f"soak_{self.requests}", rng.choice(prompts)
            submit(rid, prompt)
            self.requests += 1
            self.chunked += len(prompt) > self.chunk
            self.in_flight.add(rid)
            if rng.randrange(CANCEL_EVERY) == 0:
                victim = rng.choice(sorted(self.in_flight))
                cancel(victim)
                self.in_flight.discard(victim)
                self.cancelled += 1


@dataclasses.dataclass
class StepClock:
    """Per-step canary host time (µs) and its share of the step's wall time, in the start and end windows."""

    warm_up: int
    window: int
    total: int
    start_us: list[int] = dataclasses.field(default_factory=list)
    end_us: list[int] = dataclasses.field(default_factory=list)
    start_share: list[float] = dataclasses.field(default_factory=list)
    end_share: list[float] = dataclasses.field(default_factory=list)
    _last: tuple[int, int] | None = None  # (tap µs, perf_counter ns) at the previous sampled step

    def wants(self, step: int) -> bool:
        """Steps whose time is sampled, and the step before each window (for the first delta)."""
        first = range(self.warm_up, self.warm_up + self.window + 1)
        last = range(self.total - self.window, self.total + 1)
        return step in first or step in last

    def sample(self, step: int, tap_us: int, now_ns: int) -> None:
        last, self._last = self._last, (tap_us, now_ns)
        if last is None or not self.wants(step - 1):
            return
        canary_us, wall_us = tap_us - last[0], (now_ns - last[1]) / 1000
        at_start = step <= self.warm_up + self.window
        (self.start_us if at_start else self.end_us).append(canary_us)
        (self.start_share if at_start else self.end_share).append(canary_us / wall_us if wall_us > 0 else 0.0)


@dataclasses.dataclass
class PhaseResult:
    model: str
    steps: int
    requests: int
    cancelled: int
    stats: dict[str, int]
    features: dict[str, int]
    rss_start: int  # bytes, after warm-up
    rss_end: int
    device_start: int | None  # bytes allocated on the accelerator, None on the CPU
    device_end: int | None
    step_us_start: float  # median canary host time per step, first window after warm-up
    step_us_end: float  # the same, last window
    share_start: float  # median share of the step's wall time spent in the canary, first window
    share_end: float
    seconds: float
    engine_error: str | None = None
    chunked_prompts: int = 0  # requests whose prompt exceeds the batch token budget (chunked prefill)

    def failures(self) -> list[str]:
        why = []
        for key in ("violations", "health_failures", "adapter_errors", "hook_misses"):
            if self.stats.get(key, 0):
                why.append(f"{self.model}: {self.stats[key]} {key.replace('_', ' ')}")
        if self.engine_error is not None:
            why.append(f"{self.model}: the engine stopped: {self.engine_error}")
        rss_bound = self.rss_start * (1 + RSS_GROWTH) + RSS_SLACK_BYTES
        if self.rss_end > rss_bound:
            why.append(f"{self.model}: RSS grew from {_mib(self.rss_start)} to {_mib(self.rss_end)}")
        # Both the time and its share of the step must grow: on a shared host, load from other processes
        # stretches the canary's wall time and the step's alike, leaving the share where it was.
        grew = self.step_us_end > TIME_GROWTH * self.step_us_start and self.share_end > TIME_GROWTH * self.share_start
        if self.step_us_start > 0 and grew:
            why.append(
                f"{self.model}: step time grew from {self.step_us_start:.0f} to {self.step_us_end:.0f} µs "
                f"({self.share_start:.1%} -> {self.share_end:.1%} of the step)"
            )
        return why

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class SoakResult:
    options: SoakOptions
    engine: str  # the engine's version
    phases: list[PhaseResult]

    def failures(self) -> list[str]:
        return [why for p in self.phases for why in p.failures()]

    @property
    def passed(self) -> bool:
        return not self.failures()

    def as_json(self) -> dict[str, Any]:
        total = {k: sum(p.stats.get(k, 0) for p in self.phases) for k in ("verified_slots", "violations")}
        return {
            "passed": self.passed,
            "failures": self.failures(),
            "engine": {"name": self.options.engine, "version": self.engine},
            "steps": sum(p.steps for p in self.phases),
            "requests": sum(p.requests for p in self.phases),
            "verified_slots": total["verified_slots"],
            "violations": total["violations"],
            "health_failures": sum(p.stats.get("health_failures", 0) for p in self.phases),
            "bounds": {"rss_growth": RSS_GROWTH, "rss_slack_bytes": RSS_SLACK_BYTES, "step_time_growth": TIME_GROWTH},
            "phases": [p.as_json() for p in self.phases],
        }


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / (1 << 20):.1f} MiB"


def _rss() -> int:
    import psutil  # an optional dependency: run_soak imports it first, so that its absence is refused early

    return int(psutil.Process().memory_info().rss)


def _device_bytes(device: str) -> int | None:
    return int(torch.cuda.memory_allocated(device)) if device.startswith("cuda") else None


def _split_steps(options: SoakOptions) -> list[int]:
    share, rest = divmod(options.steps, len(options.models))
    return [share + (1 if i < rest else 0) for i in range(len(options.models))]


@dataclasses.dataclass
class PhaseProgress:
    """A phase's running state, fed by :meth:`on_step` once per canary step (from whichever thread runs the
    engine's steps) and turned into its :class:`PhaseResult` at the end."""

    label: str
    device: str
    clock: StepClock
    out: TextIO | None
    # The canary's counters: verified_slots, violations, ..., and tap_us, its host time so far.  Set once
    # the canary is installed.
    stats: Callable[[], dict[str, int]] | None = None
    steps: int = 0
    rss_start: int = 0
    device_start: int | None = None
    started: float = dataclasses.field(default_factory=time.perf_counter)

    @classmethod
    def for_phase(cls, label: str, steps: int, options: SoakOptions, out: TextIO | None) -> PhaseProgress:
        window = max(int(steps * WINDOW_SHARE), 5)
        warm_up = max(int(steps * WARM_UP_SHARE), min(WARM_UP_MIN_STEPS, steps // 2), 5)
        clock = StepClock(warm_up=warm_up, window=window, total=steps)
        return cls(label, options.device, clock, out)

    def on_step(self, step: int) -> None:
        assert self.stats is not None, "PhaseProgress.stats is set when the canary is installed"
        self.steps = step
        if self.clock.wants(step):
            self.clock.sample(step, self.stats()["tap_us"], time.perf_counter_ns())
        if step == self.clock.warm_up:
            self.rss_start = _rss()
            self.device_start = _device_bytes(self.device)
        if self.out is not None and step % _PROGRESS_EVERY == 0:
            s = self.stats()
            print(f"  [soak {self.label}] step {step:,}: {s['verified_slots']:,} slots verified, "
                  f"{s['violations']} violations, RSS {_mib(_rss())}",
                  file=self.out, flush=True)  # fmt: skip

    def result(
        self, *, requests: int, cancelled: int, features: dict[str, int], engine_error: str | None,
        chunked_prompts: int = 0,
    ) -> PhaseResult:  # fmt: skip
        assert self.stats is not None, "PhaseProgress.stats is set when the canary is installed"
        c = self.clock
        return PhaseResult(
            model=self.label, steps=self.steps, requests=requests, cancelled=cancelled, stats=self.stats(),
            features=features, rss_start=self.rss_start, rss_end=_rss(),
            device_start=self.device_start, device_end=_device_bytes(self.device),
            step_us_start=_median(c.start_us), step_us_end=_median(c.end_us),
            share_start=_median(c.start_share), share_end=_median(c.end_share),
            seconds=time.perf_counter() - self.started, engine_error=engine_error, chunked_prompts=chunked_prompts,
        )  # fmt: skip


def _median(values: list[int] | list[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def run_soak(options: SoakOptions, progress: TextIO | None = sys.stderr) -> SoakResult:
    """Every phase of ``options``, one after the other, on the engine's own soak workload."""
    import psutil  # noqa: F401  (the RSS readings; missing: an ImportError, the environment's refusal)

    engine = importlib.import_module(SOAK_ENGINES[options.engine].module)
    version: str = engine.engine_version()
    steps = _split_steps(options)
    phases = [engine.run_phase(m, n, options, progress) for m, n in zip(options.models, steps, strict=True)]
    return SoakResult(options, version, phases)


def summary(result: SoakResult) -> str:
    o = result.options
    lines = [
        f"kvcanary soak: {o.engine} {result.engine}, {o.steps:,} steps over {', '.join(o.models)}, seed {o.seed}, "
        f"device {o.device}, canary backend {o.backend.value}",
        f"bounds after warm-up ({WARM_UP_SHARE:.0%} of a phase, at least {WARM_UP_MIN_STEPS} steps or half): "
        f"RSS growth <= {RSS_GROWTH:.0%} + "
        f"{_mib(RSS_SLACK_BYTES)}; median step time, last {WINDOW_SHARE:.0%} / first {WINDOW_SHARE:.0%} "
        f"<= {TIME_GROWTH}",
    ]
    for p in result.phases:
        s, f = p.stats, p.features
        lines += [
            "",
            f"{p.model}: {p.steps:,} steps, {p.requests:,} requests ({p.cancelled} cancelled), "
            f"{s['verified_slots']:,} slots verified, {s['violations']} violations, "
            f"{s['health_failures']} health failures ({p.seconds:.1f} s)",
            f"  engine features: chunked prefills {p.chunked_prompts}"
            + "".join(f", {name.replace('_', ' ')} {n:,}" for name, n in f.items() if n),
            f"  host RSS {_mib(p.rss_start)} -> {_mib(p.rss_end)}; device memory {_mib(p.device_start)} -> "
            f"{_mib(p.device_end)}; canary host time per step (median) {p.step_us_start:.0f} -> "
            f"{p.step_us_end:.0f} µs ({p.share_start:.0%} -> {p.share_end:.0%} of the step)",
        ]
    failures = result.failures()
    lines.append("")
    lines.append("result: PASS" if not failures else "result: FAIL (" + "; ".join(failures) + ")")
    return "\n".join(lines)
