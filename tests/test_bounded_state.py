"""Nothing the canary keeps grows with the number of requests served (transformers engine on CPU).

One ``ContinuousBatchingManager`` serves N requests, then 3N more (4N in all) on the same cache, so
the same canary binding sees them all.  After each wave the sizes of what the adapter keeps are
taken: kept reports, the fail-request bookkeeping of reported requests, the records of the CPU swap
pool, the translation's staging buffer and the timer's window.  Each must be bounded by the pool,
batch or a fixed cap, so the sizes after 4N requests may not exceed those after N (or the cap).

Two workloads: a clean one in ``log`` mode with the demo's engine settings (forks, CPU offloads and
restores), and a storm in ``fail-request`` mode where every request's context is corrupt (every record
scrambled before each step, as in tests/test_storm.py), so every request is reported and failed.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

pytest.importorskip("transformers")

from kvcanary import CanaryConfig, Mode
from kvcanary.adapters.transformers_cb import install
from kvcanary.adapters.transformers_cb.adapter import TransformersCBAdapter
from kvcanary.adapters.transformers_cb.tap_timer import RECENT_STEPS
from kvcanary.demo import build_model, build_prompts, engine_configs, quiet_engine_logs
from storm_probe import StormProbe

N = 8
NEW_TOKENS = 4
BLOCKS = 24  # of 8 tokens: a wave of N requests (two sequences each) overflows it, forcing offloads
KEPT = 4  # max_kept_reports


def state_sizes(adapter: TransformersCBAdapter) -> dict[str, int]:
    """What the adapter keeps that could grow with the requests served."""
    binding = adapter._bindings.current
    assert binding is not None
    host = binding.host._stores
    return {
        "kept_reports": len(adapter.reports),
        "reported_requests": len(adapter._modes._reported),
        "requests_to_fail": len(adapter._modes._to_fail),
        "host_record_slots": sum(s.num_slots for s in host.values()),
        "staging_bytes": binding.translator._staging._capacity,
        "timer_window": len(adapter._tap.timer._recent),
    }


def serve(manager: Any, prompts: list[list[int]], first: int, timeout_s: float = 60.0) -> dict[str, Any]:
    """Add requests ``first``.. for ``prompts`` and wait for each one's final result (forks report as children)."""
    ids = {f"req_{first + i}" for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        manager.add_request(prompt, request_id=f"req_{first + i}", max_new_tokens=NEW_TOKENS)
    results: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    while ids - results.keys():
        assert time.monotonic() < deadline, f"requests never finished: {sorted(ids - results.keys())}"
        out = manager.get_result(timeout=0.1)
        if out is not None and out.request_id in ids and out.is_finished():
            results[out.request_id] = out
    return results


def two_waves(mode: Mode, storm: bool) -> tuple[dict[str, int], dict[str, int], TransformersCBAdapter, list[Any]]:
    model = build_model("dense")
    calls: list[list[object]] = []
    callback = (lambda ids, report: calls.append(ids)) if mode is Mode.FAIL_REQUEST else None
    gen, cb = engine_configs("dense", NEW_TOKENS, seed=0)
    cb.num_blocks = BLOCKS
    if storm:  # one sequence a request: each request is failed once, by its own id
        gen.num_return_sequences = 1
    prompts = build_prompts(4 * N)
    with quiet_engine_logs():
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        adapter = install(manager, CanaryConfig(mode=mode), on_fail_request=callback, max_kept_reports=KEPT)
        if storm:
            adapter.set_input_probe(StormProbe(adapter))
        manager.start()
        try:
            results = list(serve(manager, prompts[:N], 0).values())
            after_n = state_sizes(adapter)
            results += serve(manager, prompts[N:], N).values()  # a fail-request storm hung here before modes.py's fix
            after_4n = state_sizes(adapter)
        finally:
            manager.stop(block=True, timeout=30)
            adapter.flush()
            adapter.uninstall()
    return after_n, after_4n, adapter, results if not storm else [calls, results]


def test_a_clean_run_with_offloads_keeps_nothing_per_request() -> None:
    after_n, after_4n, adapter, results = two_waves(Mode.LOG, storm=False)
    stats, features = adapter.stats(), adapter.features()
    assert stats["violations"] == 0 and all(r.error is None for r in results)
    assert features["offloads"] > 0 and features["restores"] > 0 and features["forks"] > 0
    assert after_n["host_record_slots"] > 0  # the swap pool's records exist ...
    for key, size in after_4n.items():  # ... and nothing grew with three times more requests
        assert size <= max(after_n[key], 0 if key != "timer_window" else RECENT_STEPS), (key, after_n, after_4n)


def test_a_fail_request_storm_keeps_no_bookkeeping_of_finished_requests() -> None:
    after_n, after_4n, adapter, (calls, results) = two_waves(Mode.FAIL_REQUEST, storm=True)
    failed = [rid for call in calls for rid in call]
    assert sorted(failed) == sorted(f"req_{i}" for i in range(4 * N)), "each request failed once"
    assert all(r.error is not None for r in results)
    assert adapter.stats()["reports"] > 4 * KEPT and after_4n["kept_reports"] == KEPT
    # Reported ids are remembered for a few steps (lagged reports can name a failed request again), not for good.
    remembered = adapter._modes._reported
    assert 0 < after_4n["reported_requests"] < 4 * N and max(remembered.values()) - min(remembered.values()) <= 8
    for key in ("requests_to_fail", "staging_bytes"):
        assert after_4n[key] <= after_n[key], (key, after_n, after_4n)
