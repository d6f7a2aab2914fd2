"""``fail-request`` and ``raise`` on the real engine, with a fault of the vLLM library corrupting vLLM's state.

fail-request: the corrupted request finishes with ``finish_reason == "error"`` through the scheduler's finish
path, and every other request's output equals a clean run's.  raise: the engine stops with the violation as
the cause (this breaks the in-process engine, so that test runs last: see conftest).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvcanary.adapters.vllm import install
from kvcanary.adapters.vllm.selftest.context import VllmInjector
from kvcanary.adapters.vllm.selftest.faults import BlockTableCrossRequest
from kvcanary.adapters.vllm.workload import generate, make_workload
from kvcanary.runtime import CanaryViolation
from kvcanary.selftest.protocol import InjectMode

TARGET_STEP = 30


def _inject(llm: Any, canary: Any) -> VllmInjector:
    target = (BlockTableCrossRequest.spec.name, TARGET_STEP)
    ctx = VllmInjector(InjectMode.INJECT, rng=random.Random(7), target=target, llm=llm, canary=canary)
    BlockTableCrossRequest().install(ctx)
    return ctx


def test_fail_request_fails_only_the_corrupted_request(llm: Any) -> None:
    workload = make_workload(seed=3, num_requests=12)
    llm.reset_prefix_cache()
    clean = generate(llm, workload)
    llm.reset_prefix_cache()
    failed: list[object] = []
    canary = install(llm, "fail-request", on_fail_request=lambda ids, report: failed.extend(ids))
    assert canary is not None
    ctx = _inject(llm, canary)
    try:
        outs = llm.generate(workload.requests(), workload.sampling(), use_tqdm=False)
    finally:
        ctx.patches.restore()
        canary.uninstall()
    assert ctx.injection is not None and not ctx.errors
    victim = ctx.injection.requests[0]
    assert failed == [victim], (failed, ctx.injection)
    victim = victim.rsplit("-", 1)[0]  # the engine core's id is the caller's plus a random suffix
    by_id = {o.request_id: o for o in outs}
    assert by_id[victim].outputs[0].finish_reason == "error"
    others = [i for i, o in enumerate(outs) if o.request_id != victim]
    assert len(others) == len(outs) - 1
    for i in others:
        assert outs[i].outputs[0].finish_reason == "length"
        assert list(outs[i].outputs[0].token_ids) == clean[i], f"request {outs[i].request_id} changed"
    assert canary.features()["failed_requests"] == 1


@pytest.mark.stops_engine
def test_raise_stops_the_engine_with_the_violation(llm: Any) -> None:
    workload = make_workload(seed=3, num_requests=12)
    llm.reset_prefix_cache()
    canary = install(llm, "raise")
    assert canary is not None
    ctx = _inject(llm, canary)
    with pytest.raises(CanaryViolation) as info:
        llm.generate(workload.requests(), workload.sampling(), use_tqdm=False)
    assert ctx.injection is not None
    assert ctx.injection.requests[0] in {str(r) for r in info.value.report.affected_request_ids}, info.value
    assert "link_mismatch" in info.value.report.counts or "token_mismatch" in info.value.report.counts
