"""The sglang soak workload on the session's scheduler: a clean run passes and does what it claims; a fault fails it.

CI runs the command itself (``kvcanary soak --engine sglang`` in scripts/ci-sglang.sh); these tests run short
phases on the session's scheduler (sglang builds one per process) and check what the summary cannot show.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvcanary.adapters.sglang.soak import MAX_IN_FLIGHT, run_phase
from kvcanary.soak import SoakOptions

STEPS = 300


def _options(steps: int = STEPS, **extra: Any) -> SoakOptions:
    return SoakOptions(steps=steps, engine="sglang", **extra)


def test_a_short_soak_is_silent_steady_and_exercises_sglangs_features(loop) -> None:
    tracked: list[int] = []  # requests in the loop's bookkeeping, at each forward

    def track(batch: Any) -> None:
        tracked.append(len(loop.requests))

    result = run_phase("dense", STEPS, _options(), None, loop=loop, before_forward=track)
    assert result.failures() == [] and result.engine_error is None
    assert result.steps == STEPS and len(tracked) == STEPS  # one canary step per scheduler forward
    s = result.stats
    assert s["violations"] == 0 and s["health_failures"] == 0 and s["hook_misses"] == 0
    assert s["verified_slots"] > 20 * STEPS and s["tap_us"] > 0, s
    f = result.features
    claimed = ("prefix_hits", "chunked_rows", "chunk_continuations", "mixed_batches", "retractions", "reused_slots")
    assert all(f[name] > 0 for name in claimed), f
    assert f["aborted_running"] + f["aborted_waiting"] == result.cancelled > 0
    assert 0 < result.chunked_prompts <= result.requests
    assert max(tracked) <= 2 * MAX_IN_FLIGHT  # finished requests leave the loop's bookkeeping


def test_the_same_seed_runs_the_same_soak(loop) -> None:
    runs = [run_phase("dense", 100, _options(100, seed=5), None, loop=loop) for _ in range(2)]
    a, b = ((r.requests, r.cancelled, r.features, r.stats["verified_slots"]) for r in runs)
    assert a == b
    other = run_phase("dense", 100, _options(100, seed=6), None, loop=loop)
    assert (other.requests, other.features) != (runs[0].requests, runs[0].features)


class ForeignSlotOnce:
    """At the first decode batch of two or more rows from ``at`` on, row 0's position 1 points at row 1's first
    slot for that one forward (restored at the next batch, so sglang's frees stay sound)."""

    def __init__(self, loop: Any, at: int) -> None:
        self.loop, self.at = loop, at
        self.undo: tuple[int, int, int] | None = None
        self.struck_at: int | None = None

    def __call__(self, batch: Any) -> None:
        table = self.loop.scheduler.req_to_token_pool.req_to_token
        if self.undo is not None:
            row, pos, slot = self.undo
            table[row, pos] = slot
            self.undo = None
        seq = batch.seq_lens_cpu.tolist()
        if self.struck_at is not None or self.loop.forwards_started < self.at or not batch.forward_mode.is_decode():
            return
        if len(seq) < 2 or min(seq[:2]) < 3:
            return
        rows = [int(r) for r in batch.req_pool_indices.tolist()[:2]]
        victim, foreign = int(table[rows[0], 1]), int(table[rows[1], 0])
        if victim != foreign:
            table[rows[0], 1] = foreign
            self.undo, self.struck_at = (rows[0], 1, victim), self.loop.forwards_started


def test_a_corrupted_slot_mapping_mid_run_fails_the_soak(loop) -> None:
    fault = ForeignSlotOnce(loop, at=STEPS // 2)
    result = run_phase("dense", STEPS, _options(), None, loop=loop, before_forward=fault)
    assert fault.struck_at is not None
    assert result.stats["violations"] > 0 and not result.engine_error
    assert result.steps == STEPS  # log mode: the engine kept serving
    assert any("violations" in why for why in result.failures()), result.failures()


def test_a_device_sglangs_cpu_path_cannot_use_is_refused_before_anything_runs(loop) -> None:
    forwards = loop.forwards_started
    with pytest.raises(ValueError, match="CPU only"):
        run_phase("dense", STEPS, _options(device="cuda"), None, loop=loop)
    with pytest.raises(ValueError, match="dense"):
        run_phase("hybrid", STEPS, _options(), None, loop=loop)
    assert loop.forwards_started == forwards and loop.canary is None


def test_an_engine_error_mid_run_is_reported_not_raised(loop) -> None:
    def broken_engine(batch: Any) -> None:
        if loop.forwards_started >= 50:
            raise RuntimeError("the engine broke")

    result = run_phase("dense", STEPS, _options(), None, loop=loop, before_forward=broken_engine)
    assert result.engine_error == "RuntimeError: the engine broke" and result.steps == 49
    assert any("the engine stopped: RuntimeError: the engine broke" in why for why in result.failures())
    assert loop.canary is None and loop.idle  # the loop was reset for the next run
