"""Corrupt engine values are violations; malformed ground truth is API misuse (issue 10, items 5 and 7)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import compiled_build
from kvcanary import Mode, StepBatch
from kvcanary.runtime import CanaryManager, CanaryViolation
from runtime_helpers import Workload, make_manager, run_step


def _corrupt(batch: StepBatch, **values: list[int]) -> StepBatch:
    return dataclasses.replace(batch, **{k: torch.tensor(v, dtype=torch.int32) for k, v in values.items()})


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        ({"prefix_lens": [-4, 2]}, "length_out_of_range"),
        ({"prefix_lens": [3, 40]}, "length_out_of_range"),  # beyond the table width 32
        ({"rows": [1, 9]}, "row_out_of_range"),
    ],
)
def test_corrupt_lengths_are_reported_in_log_mode_and_serving_goes_on(
    edit: dict[str, list[int]], reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    mgr = make_manager(Mode.LOG, check_values=True)
    wl = Workload()
    run_step(mgr, wl.batch([(1, 3), (2, 2)]), ["a", "b"])
    run_step(mgr, _corrupt(wl.batch([(1, 1), (2, 1)]), **edit), ["a", "b"])  # no ValueError from the engine's step
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        report = run_step(mgr, wl.batch([(1, 1)]), ["a"])
    assert report is not None and report.counts == {reason: 1}
    assert report.violations[0].phase == "plan"
    assert report.affected_request_ids == (("a",) if edit.get("prefix_lens", [0])[0] < 0 else ("b",))
    assert reason in caplog.text
    later = mgr.flush()  # serving went on; the skipped write may surface later as never_written, never as an error
    assert later is None or reason not in later.counts


def test_corrupt_lengths_raise_canary_violation_in_raise_mode() -> None:
    mgr = make_manager(Mode.RAISE, check_values=True)
    wl = Workload()
    run_step(mgr, wl.batch([(1, 3)]), ["a"])
    run_step(mgr, _corrupt(wl.batch([(1, 1)]), extend_lens=[-1]), ["a"])
    with pytest.raises(CanaryViolation, match="length_out_of_range"):
        mgr.flush()


def test_api_misuse_still_raises_before_any_state_changes() -> None:
    mgr = make_manager(Mode.LOG, check_values=True)
    wl = Workload()
    batch = wl.batch([(1, 3)])
    with pytest.raises(TypeError, match="prefix_lens must be int32 or int64"):
        mgr.before_forward({"full": dataclasses.replace(batch, prefix_lens=batch.prefix_lens.float())})
    run_step(mgr, batch, ["a"])  # the refused call left the manager usable
    assert mgr.flush() is None


def _truth_batch(**edit: object) -> tuple[CanaryManager, StepBatch]:
    mgr = make_manager(Mode.LOG, check_values=True)
    wl = Workload()
    run_step(mgr, wl.batch([(1, 3)], truth=True), ["a"])
    return mgr, dataclasses.replace(wl.batch([(1, 1)], truth=True), **edit)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda b: {"truth": b.truth[:1]}, r"truth has 1 rows, but batch rows \[0\] use table rows \[1\]"),
        (lambda b: {"truth_lens": torch.tensor([33], dtype=torch.int32)}, r"truth_lens exceeds the truth's width 32"),
        (lambda b: {"truth": b.truth[:, :2].contiguous()}, r"truth_lens exceeds the truth's width 2"),
    ],
)
def test_malformed_truth_is_refused_before_any_state_changes(edit, match: str) -> None:  # type: ignore[no-untyped-def]
    mgr, good = _truth_batch()
    bad = dataclasses.replace(good, **edit(good))
    before = [c.records.links.clone() for c in mgr.canaries.values()]
    with pytest.raises(ValueError, match=match):
        mgr.before_forward({"full": bad})
    assert all(torch.equal(b, c.records.links) for b, c in zip(before, mgr.canaries.values(), strict=True))
    run_step(mgr, good, ["a"])  # refused, not half-applied: the good batch still runs clean
    assert mgr.flush() is None


@compiled_build.patches("kvcanary.runtime.manager")
def test_corrupt_lengths_on_the_transformers_engine_are_violations_not_skipped_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("transformers")
    from kvcanary import CanaryConfig
    from kvcanary.adapters.transformers_cb import install
    from kvcanary.demo import build_model
    from transformers_helpers import tiny_generate

    original = CanaryManager.before_forward
    steps = {"n": 0}

    def corrupting(self: CanaryManager, batches: dict[str, StepBatch]) -> None:
        # The engine's bookkeeping goes wrong once: one request's past length turns negative.
        steps["n"] += 1
        if steps["n"] == 3:
            batches = {
                name: dataclasses.replace(
                    b, prefix_lens=torch.where(torch.arange(b.batch_size) == 0, -7, b.prefix_lens)
                )
                for name, b in batches.items()
            }
        original(self, batches)

    monkeypatch.setattr(CanaryManager, "before_forward", corrupting)
    model = build_model("dense")
    with install(model, CanaryConfig(mode=Mode.LOG, check_values=True)) as canary:
        outputs = tiny_generate(model)
        canary.flush()
        stats, reports = canary.stats(), canary.reports
    assert len(outputs) == 4  # generation went on
    assert stats["adapter_errors"] == 0  # the step was checked, not skipped as the canary's own failure
    assert stats["violations"] >= 1
    assert any("length_out_of_range" in r.counts for r in reports), [r.block() for r in reports]
