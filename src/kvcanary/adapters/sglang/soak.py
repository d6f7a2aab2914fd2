"""The sglang soak workload (``kvcanary soak --engine sglang``; the frame is :mod:`kvcanary.soak`).

sglang 0.5.23's real ``Scheduler`` in this process on the CPU (:class:`~.selftest.scheduler_loop.SchedulerLoop`:
its radix cache, allocators, schedule policy and Llama on torch-native attention; the tiny random Llama) with
the canary installed in ``log`` mode, the KV digest checking every read slot's bytes.  Requests arrive and
finish continuously: the soak keeps a random number in flight (more than the scheduler runs at once, so some
wait), each a prompt drawn from a pool built on a few shared system prompts (radix prefix hits, exact repeats),
many longer than the 16-token prefill chunk (chunked prefill, mixed batches), and a random number of new
tokens; the 96-token pool runs short during decode (``retract_decode``, then the retracted requests resume),
and about one request in ``CANCEL_EVERY`` is aborted through sglang's abort path (``AbortReq``), running or
waiting.  One phase, ``dense``.

The sglang adapter keeps no host-time counter, so the soak times the canary's per-step hooks itself
(:class:`HookTimer`, wrapped around the installed canary's methods, never inside them).
"""

from __future__ import annotations

import functools
import random
import time
import warnings
from collections.abc import Callable
from typing import Any, TextIO

from kvcanary.adapters.sglang.selftest.scheduler_loop import BatchHook, SchedulerLoop
from kvcanary.adapters.sglang.selftest.tiny_model import VOCAB
from kvcanary.soak import PhaseProgress, PhaseResult, SoakOptions, Traffic

MAX_IN_FLIGHT = 8  # requests: twice the scheduler's max_running_requests, so that some wait
PROMPT_POOL = 64
SYSTEM_PROMPTS = 4  # shared prefixes of the pool
MAX_NEW_TOKENS = 28  # longest prompt (36) + this stays within the loop's 64-token context
STALL_ITERATIONS = 1000  # loop iterations without a canary step: the run failed (requests lost)
# sglang raises its admission estimate (NewTokenRatioTracker.current) to up to 1.0 after a retraction and lets it
# fall by (init - min) / SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS a decode step: at the default 600 steps one retraction
# is followed by thousands of steps of admission too careful for the pool ever to run short again.  The soak runs
# the scheduler as a server started with SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS=1 (the fastest decay sglang allows):
# admission turns optimistic again within ~35 steps, and retractions keep coming.
RATIO_DECAY_STEPS = 1
DIGEST_BUDGET = 1.0  # the KV digest verifies every read slot's bytes, every forward
# The engine features the summary lists: the name shown <- SchedulerLoop's counter.
FEATURES = {
    "prefix_hits": "radix_hits",
    "prefix_hit_tokens": "radix_hit_tokens",
    "chunked_rows": "chunked_rows",
    "chunk_continuations": "chunk_continuations",
    "mixed_batches": "mixed",
    "retractions": "retractions",
    "resumed_after_retraction": "resumed_after_retraction",
    "aborted_running": "aborted_running",
    "aborted_waiting": "aborted_waiting",
    "reused_slots": "reused_slots",
}


def engine_version() -> str:
    from kvcanary.adapters.sglang.version import check_version

    return check_version()


class HookTimer:
    """Host time spent inside the canary's step hooks (outermost call only), and the host steps it ran."""

    def __init__(self) -> None:
        self.total_ns = 0
        self.host_steps = 0
        self._depth = 0

    def wrap(self, owner: object, name: str, *, counts_step: bool = False) -> None:
        """Replace ``owner.name`` (a bound method) on the instance by a timed call of it."""
        method: Callable[..., Any] = getattr(owner, name)

        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._depth += 1
            start = time.perf_counter_ns()
            try:
                return method(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.total_ns += time.perf_counter_ns() - start
                if counts_step:
                    self.host_steps += 1

        setattr(owner, name, timed)

    def attach(self, canary: Any) -> None:
        """Every per-step entry of the sglang canary: truth snapshot, translate+plan, after-forward, host step."""
        self.wrap(canary.translator.truth, "fill")
        self.wrap(canary, "before_forward")
        self.wrap(canary.manager, "after_forward")
        self.wrap(canary, "host_step", counts_step=True)


def build_prompts(seed: int, chunk: int) -> list[list[int]]:
    """The pool: each prompt a whole or partial shared system prompt plus its own tail; most exceed ``chunk``."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(8, 21))] for _ in range(SYSTEM_PROMPTS)]
    prompts = []
    for _ in range(PROMPT_POOL):
        system = rng.choice(systems)
        shared = system if rng.random() < 0.7 else system[: rng.randrange(2, len(system))]
        prompts.append(shared + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 17))])
    assert max(map(len, prompts)) + MAX_NEW_TOKENS <= 64 and any(len(p) > chunk for p in prompts)
    return prompts


def collect(loop: SchedulerLoop, traffic: Traffic) -> None:
    """Finished requests (and aborted ones) leave: out of flight, out of the loop's bookkeeping."""
    done = [rid for out in loop.outputs for rid, why in zip(out.rids, out.finished_reasons, strict=True) if why]
    loop.outputs.clear()
    traffic.in_flight.difference_update(done)
    loop.forget(done)


def _drive(
    loop: SchedulerLoop, timer: HookTimer, progress: PhaseProgress, target: int, traffic: Traffic,
    rng: random.Random, before_forward: BatchHook | None,
) -> None:  # fmt: skip
    """Step sglang's scheduler with requests arriving, finishing and aborted until the canary ran ``target`` steps."""
    prompts = build_prompts(rng.randrange(1 << 30), loop.config.chunked_prefill_size)

    def submit(rid: str, prompt: list[int]) -> None:
        loop.submit(rid, prompt, rng.randint(2, MAX_NEW_TOKENS))

    idle_iterations = 0
    while progress.steps < target:
        traffic.top_up(rng, prompts, submit, loop.abort)  # an aborted request's output is ignored, as an unknown rid's
        seen = timer.host_steps
        loop.step(before_forward)
        collect(loop, traffic)
        if timer.host_steps == seen:
            idle_iterations += 1
            if idle_iterations > STALL_ITERATIONS:
                raise RuntimeError(f"no canary step in {STALL_ITERATIONS} scheduler iterations (at {seen})")
            continue
        idle_iterations = 0
        progress.on_step(timer.host_steps)


def run_phase(
    model_kind: str, steps: int, options: SoakOptions, out: TextIO | None, *,
    loop: SchedulerLoop | None = None, before_forward: BatchHook | None = None,
) -> PhaseResult:  # fmt: skip
    """``steps`` canary steps of continuous traffic on sglang's scheduler.

    ``loop``: an existing scheduler to use (sglang builds one per process; it is reset before and after), else
    one is built.  ``before_forward``: called with each ``ScheduleBatch`` before its forward (tests put faults
    there)."""
    if model_kind != "dense":
        raise ValueError(f"the sglang soak runs the phase 'dense' (the tiny Llama), got {model_kind!r}")
    if options.device != "cpu":
        raise ValueError(
            f"the sglang soak runs sglang's scheduler on the CPU only (torch-native attention, Triton's interpreter "
            f"for its scheduling kernels); --device {options.device} is not supported"
        )
    from kvcanary.selftest.quiet import quiet_loggers

    with quiet_loggers("sglang"):  # retractions log a warning each
        if loop is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # sglang's import-time notices about CUDA-only kernels
                loop = SchedulerLoop()
        return _run_phase(loop, model_kind, steps, options, out, before_forward)


def _run_phase(
    loop: SchedulerLoop, label: str, steps: int, options: SoakOptions, out: TextIO | None,
    before_forward: BatchHook | None,
) -> PhaseResult:  # fmt: skip
    loop.reset()
    tracker = loop.scheduler.new_token_ratio_tracker
    sglang_decay, tracker.decay = tracker.decay, (tracker.init - tracker.min) / RATIO_DECAY_STEPS
    progress = PhaseProgress.for_phase(label, steps, options, out)
    canary = loop.install("log", kv_canary_backend=options.backend.value, kv_canary_digest_budget=DIGEST_BUDGET)
    timer = HookTimer()
    timer.attach(canary)

    def stats() -> dict[str, int]:
        missed = loop.features["forwards"] - timer.host_steps - (1 if loop.in_forward else 0)
        return {**canary.stats(), "adapter_errors": 0, "hook_misses": max(missed, 0), "tap_us": timer.total_ns // 1000}

    progress.stats = stats
    traffic, engine_error = Traffic(1, MAX_IN_FLIGHT, loop.config.chunked_prefill_size), None
    try:
        _drive(loop, timer, progress, steps, traffic, random.Random(options.seed), before_forward)
    except Exception as exc:  # the engine failing mid-run is a finding of the soak, reported, never raised
        engine_error = f"{type(exc).__name__}: {exc}"
    canary.flush()  # the last step's report
    features = {name: int(loop.features[key]) for name, key in FEATURES.items()}
    result = progress.result(
        requests=traffic.requests, cancelled=traffic.cancelled, features=features, engine_error=engine_error,
        chunked_prompts=traffic.chunked,
    )  # fmt: skip
    tracker.decay = sglang_decay
    try:
        loop.reset()  # uninstalls the canary, drops the requests still in flight, flushes sglang's cache
    except RuntimeError as exc:  # a scheduler left inconsistent by the engine's error refuses the flush
        result.engine_error = result.engine_error or f"after the run: {exc}"
    return result
