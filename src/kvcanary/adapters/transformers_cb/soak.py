"""The transformers soak workload (``kvcanary soak --engine transformers``; the frame is :mod:`kvcanary.soak`).

Requests arrive and finish continuously on one transformers ``ContinuousBatchingManager`` per phase (its
``add_request`` / ``get_result`` / ``cancel_request`` API, the generation loop on its own thread): the soak
keeps a random number of requests in flight, each a prompt drawn from the demo's pool (shared prefixes,
exact repeats: prefix hits and cached-block reuse), two sampled sequences each (forks), a random number of
new tokens, and cancels about one request in ``CANCEL_EVERY``.  The demo's block budget forces CPU offloads
and restores; its 64-token batch budget splits the long prompts (chunked prefill).  The phases: the dense
model and the hybrid (sliding + full attention: the sliding ring wraps) one, each on its own engine and
canary.
"""

from __future__ import annotations

import random
import time
from typing import Any, TextIO

from kvcanary.config import CanaryConfig, Mode
from kvcanary.soak import PhaseProgress, PhaseResult, SoakOptions, Traffic

MAX_IN_FLIGHT = 12  # requests (x 2 sequences): over the block budget (offloads), a short step
PROMPT_POOL = 256
POLL_S = 0.02
STALL_S = 120.0  # no canary step for this long: the run failed (engine stuck, requests lost)


def engine_version() -> str:
    from kvcanary.adapters.transformers_cb.version import check_version

    return check_version()


def _drive(
    manager: Any, progress: PhaseProgress, target: int, rng: random.Random, prompts: list[list[int]], chunk: int
) -> Traffic:
    """Keep requests arriving and finishing until the canary ran ``target`` steps; what was submitted."""
    traffic = Traffic(MAX_IN_FLIGHT // 3, MAX_IN_FLIGHT, chunk)

    def submit(rid: str, prompt: list[int]) -> None:
        manager.add_request(prompt, request_id=rid, max_new_tokens=rng.randint(2, 32))

    last_step, last_progress = -1, time.monotonic()
    while progress.steps < target:
        if not manager.is_running():
            raise RuntimeError("the generation thread stopped")
        if progress.steps != last_step:
            last_step, last_progress = progress.steps, time.monotonic()
        elif time.monotonic() - last_progress > STALL_S:  # requests lost, or every step skipped by the canary
            raise RuntimeError(f"no canary step in {STALL_S:.0f} s (at step {last_step})")
        traffic.top_up(rng, prompts, submit, manager.cancel_request)
        result = manager.get_result(timeout=POLL_S)
        if result is not None and result.is_finished():
            # Forked children report as "<parent>__child#i"; the parent's own result closes it.
            traffic.in_flight.discard(result.request_id)
    return traffic


def run_phase(model_kind: str, steps: int, options: SoakOptions, out: TextIO | None) -> PhaseResult:
    """One engine, one canary: ``steps`` canary steps of continuous arrivals on ``model_kind``."""
    from kvcanary.adapters.transformers_cb.selftest.workload import quiet_engine_logs

    with quiet_engine_logs():
        return _run_phase(model_kind, steps, options, out)


def _run_phase(model_kind: str, steps: int, options: SoakOptions, out: TextIO | None) -> PhaseResult:
    from kvcanary.adapters.transformers_cb import install
    from kvcanary.adapters.transformers_cb.selftest.workload import build_model, build_prompts, engine_configs

    model = build_model(model_kind, options.seed, options.device)
    prompts = build_prompts(PROMPT_POOL, options.seed)
    progress = PhaseProgress.for_phase(model_kind, steps, options, out)
    canary = install(
        model, CanaryConfig(mode=Mode.LOG), backend=options.backend, on_step=lambda step, _: progress.on_step(step)
    )
    progress.stats = canary.stats
    gen, cb = engine_configs(model_kind, 32, options.seed)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)  # type: ignore[operator]
    engine_error = None
    try:
        manager.start()
        rng = random.Random(options.seed)
        traffic = _drive(manager, progress, steps, rng, prompts, cb.max_batch_tokens)
    except RuntimeError as exc:
        engine_error, traffic = str(exc), Traffic(0, 0, 0)
    finally:
        manager.stop(block=True, timeout=30, hard_stop=True)
        canary.flush()
        canary.uninstall()
    return progress.result(
        requests=traffic.requests, cancelled=traffic.cancelled, features=canary.features(),
        engine_error=engine_error, chunked_prompts=traffic.chunked,
    )  # fmt: skip
