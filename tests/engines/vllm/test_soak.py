"""``kvcanary soak --engine vllm`` on the shared engine: a short soak is silent and exercises what it claims
(prefix hits, chunked prefill, preemption and resume, block reuse, aborts); with a fault of the vLLM library
corrupting vLLM's block table mid-soak, the verdict fails on the violations."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvcanary.adapters.vllm import hooks
from kvcanary.adapters.vllm.selftest.context import VllmInjector
from kvcanary.adapters.vllm.selftest.faults import BlockTableCrossRequest
from kvcanary.adapters.vllm.soak import run_phase, soak_engine
from kvcanary.selftest.protocol import InjectMode
from kvcanary.soak import SoakOptions

STEPS = 400
FAULT_STEP = 60


def _options(steps: int, **kw: Any) -> SoakOptions:
    return SoakOptions(steps=steps, engine="vllm", **kw)


@pytest.fixture(scope="module")
def clean(llm: Any) -> Any:
    return soak_engine(llm, "dense", STEPS, _options(STEPS), None)


def test_clean_soak_is_silent(clean: Any) -> None:
    assert clean.engine_error is None
    assert clean.steps == STEPS
    s = clean.stats
    assert s["violations"] == 0 and s["health_failures"] == 0 and s["adapter_errors"] == 0, s
    assert s["verified_slots"] > 100 * STEPS and s["tap_us"] > 0, s
    assert not [why for why in clean.failures() if "RSS" not in why], clean.failures()  # memory: the long runs


def test_clean_soak_exercises_the_engine(clean: Any) -> None:
    f = clean.features
    for name in ("prefix_hit_requests", "chunked_prefill_rows", "preempted_requests", "resumed_requests",
                 "reused_blocks", "finished_requests", "aborted_requests"):  # fmt: skip
        assert f[name] > 0, (name, f)
    assert 0 < clean.cancelled == f["aborted_requests"] < clean.requests
    assert clean.chunked_prompts > 0
    assert clean.step_us_start > 0 and clean.step_us_end > 0


def test_fault_fails_the_verdict_and_the_kept_reports_stay_bounded(llm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hooks, "MAX_KEPT_REPORTS", 2)  # read at install
    injected: list[VllmInjector] = []

    def arm(llm: Any, canary: Any) -> Any:
        target = (BlockTableCrossRequest.spec.name, FAULT_STEP)
        ctx = VllmInjector(InjectMode.INJECT, rng=random.Random(3), target=target, llm=llm, canary=canary)
        BlockTableCrossRequest().install(ctx)
        injected.append(ctx)
        return ctx.patches.restore

    result = soak_engine(llm, "dense", 2 * FAULT_STEP, _options(2 * FAULT_STEP), None, arm=arm)
    ctx = injected[0]
    assert ctx.injection is not None and not ctx.errors, (ctx.injection, ctx.errors)
    assert result.engine_error is None  # log mode: the engine keeps serving
    assert result.stats["violations"] > 0, result.stats
    assert any("violations" in why for why in result.failures()), result.failures()
    # Every report counted, two kept in full, each mapped to the engine step it came from (the fault's or later).
    canary = ctx.canary
    assert result.stats["reports"] > 2 and len(canary.reports) == 2, result.stats
    assert sorted(canary.engine_step_of) == [r.step for r in canary.reports]
    assert all(FAULT_STEP <= canary.engine_step_of[r.step] < 3 * FAULT_STEP for r in canary.reports)
    assert len(canary._recent_engine_steps) <= hooks.RECENT_STEPS


def test_cuda_is_refused() -> None:
    with pytest.raises(ValueError, match="CPU engine"):
        run_phase("dense", 100, _options(100, device="cuda"), None)
