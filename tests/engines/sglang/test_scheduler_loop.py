"""The canary inside sglang's own scheduling loop (real Scheduler, radix cache, allocator, Llama, torch-native).

Clean multi-request workloads stay silent while sglang does every scheduling move; a corrupted
``req_to_token`` entry in the live scheduler is caught at the next forward of its request.
"""

from __future__ import annotations

import pytest

from kvcanary.adapters.sglang.selftest.workload import run_workload, standard_workload
from kvcanary.runtime import CanaryViolation

FEATURES = (
    "radix_hits",
    "chunked_rows",
    "chunk_continuations",
    "mixed",
    "decode",
    "retractions",
    "resumed_after_retraction",
    "aborted_running",
    "reused_slots",
)


@pytest.mark.parametrize("seed", [0, 1])
def test_clean_workload_through_sglangs_scheduler_is_silent_and_does_everything(loop, seed: int) -> None:
    canary = loop.install("raise")
    forwards = run_workload(loop, standard_workload(seed))
    canary.flush()  # the last forward's report
    f = loop.features
    missing = [name for name in FEATURES if f[name] < 1]
    assert not missing, (missing, dict(f))
    assert f["forwards"] == forwards >= 40
    stats = canary.stats()
    assert stats["violations"] == 0 and canary.last_report is None
    assert stats["forwards"] == forwards
    assert stats["verified_slots"] > 20 * forwards, stats  # every forward re-verified its requests' contexts
    assert stats["skipped_entries"] == 0
    cf = canary.features()
    assert cf["extend_forwards"] == f["extend"] + f["mixed"] and cf["decode_forwards"] == f["decode"], (cf, f)
    assert cf["rows_with_prefix"] >= f["radix_hits"] + f["chunk_continuations"]
    assert cf["forwards_with_truth"] == forwards  # token checks ran on sglang's own snapshot of the ids, loaded once
    finished = {
        rid for out in loop.outputs for rid, reason in zip(out.rids, out.finished_reasons, strict=True) if reason
    }
    assert len(finished) == len(standard_workload(seed))  # every request ended (the aborted one as aborted)


def test_the_same_seed_takes_the_same_path_after_a_reset(loop) -> None:
    """The self-test's control and faulted runs rely on it."""
    runs = []
    for _ in range(2):
        loop.install("log")
        run_workload(loop, standard_workload(3))
        runs.append((dict(loop.features), [list(o.output_ids[0]) for o in loop.outputs if o.output_ids]))
        loop.reset()
    assert runs[0] == runs[1]


def test_req_to_token_entry_into_another_requests_slot_is_caught_in_the_live_scheduler(loop) -> None:
    loop.install("raise")
    injected: list[tuple[str, int]] = []

    def corrupt(batch) -> None:
        if injected or not batch.forward_mode.is_decode() or len(batch.reqs) < 2:
            return
        row_a, row_b = (int(r) for r in batch.req_pool_indices[:2])
        table = loop.scheduler.req_to_token_pool.req_to_token
        pos = 3
        table[row_a, pos] = table[row_b, pos + 1]
        injected.append((batch.reqs[0].rid, pos))

    with pytest.raises(CanaryViolation) as excinfo:
        run_workload(loop, standard_workload(0), before_forward=corrupt)
    assert injected
    rid, pos = injected[0]
    violations = excinfo.value.report.violations
    assert {v.request_id for v in violations} == {rid}
    assert any(v.expected_position == pos and v.phase == "verify" for v in violations)
