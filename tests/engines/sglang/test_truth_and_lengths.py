"""Ground truth and corrupt lengths on sglang's real pools (issue 10, items 4 and 5).

Truth: each request's ``origin_input_ids + output_ids`` as sglang's ``ForwardBatch.init_new``
snapshots them (``req_all_ids_flat`` / ``req_all_ids_lens``).  Lengths: a corrupt ``seq_lens`` is a
violation (``length_out_of_range``), serving goes on in log mode, raise mode raises CanaryViolation.
"""

from __future__ import annotations

import logging

import pytest
from sglang_harness import Engine

from kvcanary.runtime import CanaryViolation


def _submit(eng: Engine) -> None:
    eng.submit("a", [3 + j for j in range(20)], max_new=12)
    eng.submit("b", [50 + j for j in range(20)], max_new=12)


def _until_decoding(eng: Engine, past: int = 3) -> None:
    for _ in range(60):
        if sum(r.cached >= r.prompt_len + past for r in eng.running) == 2:
            return
        assert eng.step()
    raise AssertionError("the requests never reached decode")


def test_clean_run_with_truth_is_silent_and_every_forward_carries_it() -> None:
    eng = Engine(pool_size=160, rows=3, chunk=32)
    _submit(eng)
    eng.run()
    assert eng.canary is not None and eng.canary.last_report is None and len(eng.finished) == 2
    f = eng.canary.features()
    assert f["forwards_with_truth"] == f["forwards"] > 10
    assert eng.canary.stats()["verified_slots"] > 300


def test_a_wrong_token_id_in_a_request_is_token_mismatch_for_that_request() -> None:
    eng = Engine(pool_size=160, rows=3, chunk=32)
    _submit(eng)
    _until_decoding(eng)
    b = next(r for r in eng.running if r.rid == "b")
    b.tokens[5] = (b.tokens[5] + 1) % 97  # the scheduler's ids now disagree with the KV written for b
    with pytest.raises(CanaryViolation) as info:
        for _ in range(3):
            eng.step()
    report = info.value.report
    assert set(report.counts) == {"token_mismatch"}, report.block()
    assert report.affected_request_ids == ("b",)
    v = report.violations[0]
    assert (v.expected_position, v.expected_token, v.stored_token) == (5, b.tokens[5], 50 + 5)


def test_without_the_snapshot_token_checks_are_off_not_wrong() -> None:
    eng = Engine(pool_size=160, rows=3, chunk=32, truth=False)
    _submit(eng)
    _until_decoding(eng)
    b = next(r for r in eng.running if r.rid == "b")
    b.tokens[5] = (b.tokens[5] + 1) % 97
    eng.run()  # raise mode: nothing to raise, the ids were never passed
    assert eng.canary is not None and eng.canary.features()["forwards_with_truth"] == 0


class CorruptSeqLens(Engine):
    """The engine's decode bookkeeping goes wrong once: request a's seq_len is past the table."""

    corrupt_at = -1

    def _forward(self, fb) -> None:  # type: ignore[no-untyped-def]
        if self.features["decode_steps"] == self.corrupt_at and fb.forward_mode.is_decode():
            fb.seq_lens[0] = 10_000
        super()._forward(fb)


def test_corrupt_seq_lens_is_a_violation_and_log_mode_keeps_serving(caplog: pytest.LogCaptureFixture) -> None:
    eng = CorruptSeqLens(pool_size=160, rows=3, chunk=32, mode="log")
    eng.corrupt_at = 2
    _submit(eng)
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        eng.run()  # no ValueError out of model.forward
    assert len(eng.finished) == 2
    assert eng.canary is not None
    reports = list(eng.canary.recent_reports)
    assert set(reports[0].counts) == {"length_out_of_range"}, reports[0].block()
    assert reports[0].affected_request_ids == ("a",)
    # The row's write was not stamped (its lengths could not be trusted), so its slot reads as never written.
    assert all("length_out_of_range" not in r.counts for r in reports[1:])
    assert "length_out_of_range" in caplog.text


def test_corrupt_seq_lens_raises_canary_violation_in_raise_mode() -> None:
    eng = CorruptSeqLens(pool_size=160, rows=3, chunk=32, mode="raise")
    eng.corrupt_at = 2
    _submit(eng)
    with pytest.raises(CanaryViolation, match="length_out_of_range"):
        eng.run()
