"""``kvcanary soak``: a long randomized clean workload on a real engine, checked for silence and steadiness.

Requests arrive and finish continuously on one transformers ``ContinuousBatchingManager`` (its
``add_request`` / ``get_result`` / ``cancel_request`` API, the generation loop on its own thread):
the soak keeps a random number of requests in flight, each a prompt drawn from the demo's pool
(shared prefixes, exact repeats: prefix hits and cached-block reuse), two sampled sequences each
(forks), a random number of new tokens, and cancels about one request in :data:`CANCEL_EVERY`.
The demo's block budget forces CPU offloads and restores; its 64-token batch budget splits the long
prompts (chunked prefill).  The steps are split between the dense model and the hybrid
(sliding + full attention: the sliding ring wraps) one, each on its own engine and canary.

The verdict (exit 0) needs, in every phase: no violation, no health failure, no adapter error, and a
steady state after warm-up (the first :data:`WARM_UP_SHARE` of the phase's steps):

* host RSS at the end <= RSS after warm-up x (1 + :data:`RSS_GROWTH`) + :data:`RSS_SLACK_BYTES`;
* the median canary host time per step over the last :data:`WINDOW_SHARE` of the steps <=
  :data:`TIME_GROWTH` x the median over the first such window after warm-up, or, if not, the median
  share of each step's wall time spent in the canary did not grow by that factor either (so load from
  other processes on a shared host, which stretches the canary and the engine alike, is not a failure).
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import psutil
import torch

from kvcanary.config import CanaryConfig, Mode
from kvcanary.ops import Backend

PHASE_MODELS: tuple[str, ...] = ("dense", "hybrid")
WARM_UP_SHARE = 0.1  # of a phase's steps: kernel compilation, allocator growth, caches filling
WINDOW_SHARE = 0.1  # of a phase's steps: the start and end windows of the per-step time
RSS_GROWTH = 0.02
RSS_SLACK_BYTES = 16 << 20  # allocator granularity and Python's free lists, not per-request growth
TIME_GROWTH = 1.5
CANCEL_EVERY = 12
MAX_IN_FLIGHT = 12  # requests (x 2 sequences): over the block budget (offloads), a short step
PROMPT_POOL = 256
_PROGRESS_EVERY = 1000
_POLL_S = 0.02
STALL_S = 120.0  # no canary step for this long: the run failed (engine stuck, requests lost)


@dataclasses.dataclass(frozen=True)
class SoakOptions:
    steps: int = 5000
    seed: int = 0
    device: str = "cpu"
    backend: Backend = Backend.AUTO
    models: tuple[str, ...] = PHASE_MODELS

    def __post_init__(self) -> None:
        unknown = [m for m in self.models if m not in PHASE_MODELS]
        if unknown or not self.models or len(set(self.models)) != len(self.models):
            names = ", ".join(PHASE_MODELS)
            raise ValueError(f"--models takes distinct names from {names}, got {','.join(self.models)!r}")
        if self.steps < 20 * len(self.models):
            raise ValueError(f"--steps must be at least {20 * len(self.models)}, got {self.steps}")


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
    engine: str
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
            "engine": {"name": "transformers", "version": self.engine},
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


def _device_bytes(device: str) -> int | None:
    return int(torch.cuda.memory_allocated(device)) if device.startswith("cuda") else None


def _split_steps(options: SoakOptions) -> list[int]:
    share, rest = divmod(options.steps, len(options.models))
    return [share + (1 if i < rest else 0) for i in range(len(options.models))]


@dataclasses.dataclass
class _Progress:
    """Shared between the engine's generation thread (on_step) and the driving loop."""

    clock: StepClock
    canary: Any = None  # the adapter, set once installed (its on_step callback is given at install)
    steps: int = 0
    rss_start: int = 0
    device_start: int | None = None


def _on_step(progress: _Progress, device: str, label: str, out: TextIO | None) -> Callable[..., None]:
    def on_step(step: int, _: object) -> None:
        progress.steps = step
        canary = progress.canary
        if progress.clock.wants(step):
            progress.clock.sample(step, canary.stats()["tap_us"], time.perf_counter_ns())
        if step == progress.clock.warm_up:
            progress.rss_start = psutil.Process().memory_info().rss
            progress.device_start = _device_bytes(device)
        if out is not None and step % _PROGRESS_EVERY == 0:
            s = canary.stats()
            print(f"  [soak {label}] step {step:,}: {s['verified_slots']:,} slots verified, "
                  f"{s['violations']} violations, RSS {_mib(psutil.Process().memory_info().rss)}",
                  file=out, flush=True)  # fmt: skip

    return on_step


def _drive(
    manager: Any, progress: _Progress, target: int, rng: random.Random, prompts: list[list[int]], chunk: int
) -> tuple[int, int, int]:
    """Keep requests arriving and finishing until the canary ran ``target`` steps.

    Returns (requests, cancelled, prompts longer than ``chunk`` tokens: prefilled in several steps)."""
    in_flight: set[str] = set()
    requests = cancelled = chunked = 0
    last_step, last_progress = -1, time.monotonic()
    while progress.steps < target:
        if not manager.is_running():
            raise RuntimeError("the generation thread stopped")
        if progress.steps != last_step:
            last_step, last_progress = progress.steps, time.monotonic()
        elif time.monotonic() - last_progress > STALL_S:  # requests lost, or every step skipped by the canary
            raise RuntimeError(f"no canary step in {STALL_S:.0f} s (at step {last_step})")
        while len(in_flight) < rng.randint(MAX_IN_FLIGHT // 3, MAX_IN_FLIGHT):
            rid = f"soak_{requests}"
            prompt = rng.choice(prompts)
            manager.add_request(prompt, request_id=rid, max_new_tokens=rng.randint(2, 32))
            requests, chunked = requests + 1, chunked + (len(prompt) > chunk)
            in_flight.add(rid)
            if rng.randrange(CANCEL_EVERY) == 0:
                cancel = rng.choice(sorted(in_flight))
                manager.cancel_request(cancel)
                in_flight.discard(cancel)  # a cancelled request delivers no final result
                cancelled += 1
        result = manager.get_result(timeout=_POLL_S)
        if result is not None and result.is_finished():
            # Forked children report as "<parent>__child#i"; the parent's own result closes it.
            in_flight.discard(result.request_id)
    return requests, cancelled, chunked


def run_phase(model_kind: str, steps: int, options: SoakOptions, out: TextIO | None) -> PhaseResult:
    """One engine, one canary: ``steps`` canary steps of continuous arrivals on ``model_kind``."""
    from kvcanary.adapters.transformers_cb import install
    from kvcanary.adapters.transformers_cb.selftest.workload import build_model, build_prompts, engine_configs

    model = build_model(model_kind, options.seed, options.device)
    prompts = build_prompts(PROMPT_POOL, options.seed)
    window = max(int(steps * WINDOW_SHARE), 5)
    progress = _Progress(StepClock(warm_up=max(int(steps * WARM_UP_SHARE), 5), window=window, total=steps))
    on_step = _on_step(progress, options.device, model_kind, out)
    canary = progress.canary = install(model, CanaryConfig(mode=Mode.LOG), backend=options.backend, on_step=on_step)
    gen, cb = engine_configs(model_kind, 32, options.seed)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)  # type: ignore[operator]
    engine_error = None
    started = time.perf_counter()
    try:
        manager.start()
        rng = random.Random(options.seed)
        requests, cancelled, chunked = _drive(manager, progress, steps, rng, prompts, cb.max_batch_tokens)
    except RuntimeError as exc:
        engine_error, requests, cancelled, chunked = str(exc), 0, 0, 0
    finally:
        manager.stop(block=True, timeout=30, hard_stop=True)
        canary.flush()
        canary.uninstall()
    return PhaseResult(
        model=model_kind, steps=progress.steps, requests=requests, cancelled=cancelled, stats=canary.stats(),
        features=canary.features(), rss_start=progress.rss_start, rss_end=psutil.Process().memory_info().rss,
        device_start=progress.device_start, device_end=_device_bytes(options.device),
        step_us_start=_median(progress.clock.start_us), step_us_end=_median(progress.clock.end_us),
        share_start=_median(progress.clock.start_share), share_end=_median(progress.clock.end_share),
        seconds=time.perf_counter() - started, engine_error=engine_error, chunked_prompts=chunked,
    )  # fmt: skip


def _median(values: list[int] | list[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def run_soak(options: SoakOptions, progress: TextIO | None = sys.stderr) -> SoakResult:
    from kvcanary.adapters.transformers_cb.selftest.workload import quiet_engine_logs
    from kvcanary.adapters.transformers_cb.version import check_version

    engine = check_version()
    with quiet_engine_logs():
        phases = [
            run_phase(m, n, options, progress) for m, n in zip(options.models, _split_steps(options), strict=True)
        ]
    return SoakResult(options, engine, phases)


def summary(result: SoakResult) -> str:
    o = result.options
    lines = [
        f"kvcanary soak: transformers {result.engine}, {o.steps:,} steps over {', '.join(o.models)}, seed {o.seed}, "
        f"device {o.device}, canary backend {o.backend.value}",
        f"bounds after warm-up ({WARM_UP_SHARE:.0%} of a phase): RSS growth <= {RSS_GROWTH:.0%} + "
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
            f"  engine features: chunked prefills {p.chunked_prompts}, prefix hits {f['prefix_hits']}, "
            f"cached block reuse {f['cached_block_reuse']}, "
            f"de-dup {f['dedup_swaps']}, forks {f['forks']}, offloads {f['offloads']}, restores {f['restores']}, "
            f"soft resets {f['soft_resets']}, ring wraps {f['ring_wraps']:,}",
            f"  host RSS {_mib(p.rss_start)} -> {_mib(p.rss_end)}; device memory {_mib(p.device_start)} -> "
            f"{_mib(p.device_end)}; canary host time per step (median) {p.step_us_start:.0f} -> "
            f"{p.step_us_end:.0f} µs ({p.share_start:.0%} -> {p.share_end:.0%} of the step)",
        ]
    failures = result.failures()
    lines.append("")
    lines.append("result: PASS" if not failures else "result: FAIL (" + "; ".join(failures) + ")")
    return "\n".join(lines)
