"""The canary on the real vLLM V1 engine: a clean workload of 40 requests is silent, and every engine feature
the acceptance asks for really happened in it (prefix hits, same-step hits, chunked prefill, preemption and
resume, eviction and reuse of blocks), counted both by the adapter and by vLLM's own objects."""

from __future__ import annotations

from typing import Any

import pytest

from kvcanary.adapters.vllm import install
from kvcanary.adapters.vllm.workload import generate, make_workload


def _block_pool(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool


@pytest.fixture(scope="module")
def clean_run(llm: Any) -> dict[str, Any]:
    workload = make_workload(seed=0)
    llm.reset_prefix_cache()
    baseline = generate(llm, workload)  # no canary
    pool = _block_pool(llm)
    evictions = []
    original = pool._remove_cached_block_hashes

    def counting(block: Any) -> Any:
        removed = original(block)
        if removed:
            evictions.append(block.block_id)
        return removed

    pool._remove_cached_block_hashes = counting
    llm.reset_prefix_cache()
    canary = install(llm, "log")
    try:
        outputs = generate(llm, workload)
        canary.flush()
    finally:
        canary.uninstall()
        del pool._remove_cached_block_hashes
    return {
        "workload": workload,
        "baseline": baseline,
        "outputs": outputs,
        "stats": canary.stats(),
        "features": canary.features(),
        "evictions": evictions,
        "host_us": canary.host_time_per_step_us(),
    }


def test_clean_workload_is_silent(clean_run: dict[str, Any]) -> None:
    stats = clean_run["stats"]
    assert len(clean_run["workload"].prompts) >= 32
    assert stats["violations"] == 0, stats
    assert stats["health_failures"] == 0, stats
    assert stats["steps"] > 50 and stats["verified_slots"] > 10_000, stats
    print(f"\nclean workload: {stats} features={clean_run['features']} host_us_per_step={clean_run['host_us']}")


def test_log_mode_does_not_change_outputs(clean_run: dict[str, Any]) -> None:
    assert clean_run["outputs"] == clean_run["baseline"]


def test_workload_exercises_the_features(clean_run: dict[str, Any]) -> None:
    f = clean_run["features"]
    assert f["prefix_hit_requests"] >= 10 and f["prefix_hit_tokens"] >= 640, f
    assert f["chunked_prefill_rows"] >= 4, f
    assert f["preempted_requests"] >= 1 and f["resumed_requests"] >= 1, f
    assert f["reused_blocks"] >= 10, f  # blocks freed or evicted, then written again by another request
    assert len(clean_run["evictions"]) >= 1  # vLLM's block pool evicted cached blocks
    assert f["same_step_readers"] >= 1, f  # a request read blocks another request wrote in the same step
    assert f["finished_requests"] >= 32 and f["canary_errors"] == 0, f
