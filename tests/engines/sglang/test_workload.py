"""Multi-step workloads on real sglang pools: clean runs stay silent, injected bookkeeping faults are caught."""

from __future__ import annotations

import pytest
import torch
from sglang_harness import Engine, Req

from kvcanary.runtime import CanaryViolation

SYSTEM = [5, 17, 29, 41, 53, 65, 77, 89, 4, 16, 28, 40, 52, 64]  # shared prompt prefix (radix hits)


def _prompt(i: int, n: int) -> list[int]:
    return SYSTEM + [(i * 13 + j * 7 + 1) % 97 for j in range(n)]


def _workload(engine: Engine) -> None:
    for i in range(7):
        engine.submit(f"r{i}", _prompt(i, 6 + 3 * i), max_new=4 + i % 3)


@pytest.mark.parametrize("page_size", [1, 4])
def test_clean_workload_is_silent_and_exercises_the_features(page_size: int) -> None:
    eng = Engine(page_size=page_size, pool_size=112, rows=3, chunk=16)
    _workload(eng)
    eng.run()
    canary = eng.canary
    assert canary is not None
    assert canary.last_report is None  # raise mode would have raised; nothing was reported either
    assert len(eng.finished) == 7
    f = eng.features
    assert f["radix_hits"] >= 3, f
    assert f["chunked_extends"] >= 2, f
    assert f["decode_steps"] >= 5, f
    assert f["reused_slots"] >= 1, f  # finished requests' slots went to later requests
    stats = canary.stats()
    assert stats["violations"] == 0
    assert stats["verified_slots"] > 200 and stats["stamped"] > 100, stats
    assert stats["skipped_entries"] == 0
    cf = canary.features()
    assert cf["extend_forwards"] == f["extend_steps"] and cf["decode_forwards"] == f["decode_steps"]
    assert cf["rows_with_prefix"] >= f["radix_hits"]


def test_clean_sliding_window_workload_recycles_window_slots() -> None:
    eng = Engine(window=8, swa_size=40, pool_size=160, rows=3, chunk=12, radix=False)
    _workload(eng)
    eng.run()
    assert eng.canary is not None and eng.canary.last_report is None
    f = eng.features
    assert f["swa_evictions"] > 20, f
    assert f["swa_reused_slots"] > 5, f  # window slots freed out of the window were handed out again
    assert f["swa_nonidentity"] > 20, f  # full and window indices differ, so the lookup matters
    assert f["chunked_extends"] >= 2 and f["decode_steps"] >= 5, f
    assert eng.canary.stats()["violations"] == 0


def _violations(excinfo: pytest.ExceptionInfo[CanaryViolation]) -> list:
    return list(excinfo.value.report.violations)


def _until(eng: Engine, cond, limit: int = 60) -> None:
    for _ in range(limit):
        if cond():
            return
        assert eng.step(), "workload ended before the condition held"
    raise AssertionError("condition never held")


def _decoding(eng: Engine, n: int, past: int) -> list[Req]:
    return [r for r in eng.running if r.cached >= r.prompt_len + past][:n]


def test_corrupted_req_to_token_entry_is_caught_for_its_request() -> None:
    eng = Engine(pool_size=160, rows=3, chunk=32)
    eng.submit("a", [3 + j for j in range(20)], max_new=30)
    eng.submit("b", [50 + j for j in range(20)], max_new=30)
    _until(eng, lambda: len(_decoding(eng, 2, 3)) == 2)
    a, b = _decoding(eng, 2, 3)
    pos = a.cached - 3
    wrong = int(eng.rtp.req_to_token[b.row, pos])  # b's slot at the same position: another prefix's token
    eng.rtp.req_to_token[a.row, pos] = wrong
    with pytest.raises(CanaryViolation) as excinfo:
        eng.step()
        eng.step()  # the report of a step comes with the next host step
    vs = _violations(excinfo)
    assert vs and {v.request_id for v in vs} == {"a"}
    assert all("link_mismatch" in v.reasons and v.phase == "verify" and v.group == "full" for v in vs)
    # With the requests' ids as truth the wrong entry itself holds the wrong token; its successor only
    # fails the link.
    culprit = [v for v in vs if "token_mismatch" in v.reasons]
    assert [(v.slot, v.expected_position) for v in culprit] == [(wrong, pos)]
    assert all(v.reasons == ("link_mismatch",) for v in vs if v not in culprit)


def test_freed_slot_reused_while_still_referenced_is_caught() -> None:
    eng = Engine(pool_size=64, max_context=64, rows=3, chunk=16)
    eng.submit("a", [7 + j for j in range(12)], max_new=2)
    eng.run()
    b = eng.submit("b", [7 + j for j in range(12)] + [90, 91, 92, 93], max_new=20)
    _until(eng, lambda: b.cached > b.prompt_len)
    assert b.protected == 12  # b shares a's prompt through the radix tree
    shared = eng.rtp.req_to_token[b.row, :12].to(torch.int64).clone()
    eng.alloc.free(shared)  # the bug: freed while b (and the tree) still reference them
    # A new request big enough to take every free slot, the freed ones included, and overwrite them.
    eng.submit("c", [(5 * j + 2) % 97 for j in range(eng.alloc.available_size())], max_new=1)
    with pytest.raises(CanaryViolation) as excinfo:
        eng.run()
    vs = _violations(excinfo)
    assert vs and {v.request_id for v in vs} == {"b"}
    assert all(v.phase == "verify" for v in vs)
    # The freed-and-rewritten slots hold c's records (other positions; c's own chain, so the link only fails
    # where b's predecessor is not c's); position 12 fails its link alone (its predecessor changed).
    reused = [v for v in vs if v.slot in set(shared.tolist())]
    assert reused and all("position_mismatch" in v.reasons for v in reused)
    assert {v.expected_position for v in vs} <= set(range(13))


def test_wrong_full_to_window_mapping_entry_is_caught_in_the_window_group() -> None:
    eng = Engine(window=8, swa_size=48, pool_size=160, rows=3, chunk=32, radix=False)
    eng.submit("a", [3 + j for j in range(20)], max_new=30)
    eng.submit("b", [50 + j for j in range(20)], max_new=30)
    _until(eng, lambda: len(_decoding(eng, 2, 3)) == 2)
    a, b = _decoding(eng, 2, 3)
    mapping = eng.alloc.full_to_swa_index_mapping
    pos = a.cached - 2
    full_a = int(eng.rtp.req_to_token[a.row, pos])
    swa_b = int(mapping[int(eng.rtp.req_to_token[b.row, b.cached - 5])])
    assert swa_b > 0
    mapping[full_a] = swa_b  # a's window entry now points at b's window slot of another position
    with pytest.raises(CanaryViolation) as excinfo:
        eng.step()
        eng.step()
    vs = _violations(excinfo)
    assert vs and {v.request_id for v in vs} == {"a"} and {v.group for v in vs} == {"swa"}
    hit = [v for v in vs if v.expected_position == pos]
    assert hit and "position_mismatch" in hit[0].reasons and hit[0].slot == swa_b


def test_log_mode_keeps_serving_and_fail_request_names_the_request() -> None:
    eng = Engine(pool_size=160, rows=3, chunk=32, mode="fail-request")
    eng.submit("a", [3 + j for j in range(20)], max_new=12)
    eng.submit("b", [50 + j for j in range(20)], max_new=12)
    _until(eng, lambda: len(_decoding(eng, 2, 2)) == 2)
    a, b = _decoding(eng, 2, 2)
    eng.rtp.req_to_token[a.row, 5] = eng.rtp.req_to_token[b.row, 5]
    eng.run()  # keeps serving to the end
    assert len(eng.finished) == 2
    assert set(eng.failed) == {"a"}
