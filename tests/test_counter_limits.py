"""Counters started near their limits: a clean run stays silent across the wrap, a fault is reported exactly.

Over days the canary's cumulative numbers grow without bound: the plan epoch (int64; the int32 write
marks take ``1 + epoch % MARK_PERIOD`` and the int64 read marks ``epoch << READER_BITS``), the phase
marks and the per-group totals (int64, in the outbox), the host's step index.  Rather than run 2^32
steps, these tests start them just below each limit a long run crosses (the write-mark period, 2^31
and 2^32 steps, and a total of 2^62) and drive steps across it.
"""

from __future__ import annotations

import pytest

from kvcanary import Mode
from kvcanary.runtime import CanaryManager
from kvcanary.schema import Counter
from kvcanary.workspace import PlanWorkspace
from runtime_helpers import drive, make_manager

STEPS = 8
# Epochs a step or two before each limit: the write-mark period, int32's and uint32's ranges.
EPOCHS = [PlanWorkspace.MARK_PERIOD - 2, (1 << 31) - 3, (1 << 32) - 3, (1 << 40) - 1]
TOTAL_START = 1 << 62  # far beyond 2^32 steps of any batch: room for 2^62 more


def start_near_limits(mgr: CanaryManager, epoch: int, steps_done: int) -> None:
    """As if ``steps_done`` host steps had run: every cumulative counter moved to its advanced value.

    The device side (plan epochs, phase marks, totals) and the host's copies of it (the phase check,
    the totals last seen and the step index) move together, as they would have after those steps.
    """
    for canary in mgr.canaries.values():
        canary.workspace.epoch.fill_(epoch)
    work = mgr._work
    totals = work.layout.totals(work.outbox)
    totals[:, Counter.VERIFIED] = TOTAL_START
    totals[:, Counter.STAMPED] = TOTAL_START
    phase = work.layout.phase(work.outbox)
    phase[:2] = steps_done
    mgr._decoder.phase.before = mgr._decoder.phase.after = steps_done
    mgr._step = mgr._decoder.steps_decoded = steps_done


def test_mark_of_wraps_without_zero_and_fits_int32() -> None:
    period = PlanWorkspace.MARK_PERIOD
    for epoch in (period - 1, period, period + 1, 2 * period, (1 << 32) - 1, (1 << 62)):
        mark = PlanWorkspace.mark_of(epoch)
        assert 1 <= mark <= period and 2 * mark + 1 < (1 << 31)
    assert PlanWorkspace.mark_of(period) == PlanWorkspace.mark_of(0)  # the wrap: back to the first mark
    # read marks stay int64 far beyond 2^32 steps
    assert PlanWorkspace.read_mark((1 << 42), 0) < (1 << 63)


@pytest.mark.parametrize("epoch", EPOCHS)
def test_clean_run_across_the_limit_is_silent(epoch: int) -> None:
    mgr = make_manager(Mode.RAISE)
    start_near_limits(mgr, epoch, steps_done=(1 << 32) - 3)
    reports = drive(mgr, STEPS)
    assert reports == [None] * STEPS and mgr.flush() is None
    s = mgr.stats()
    assert s["violations"] == 0 and s["health_failures"] == 0
    # The same counts as the fresh run of test_runtime_manager, on top of the starting totals.
    assert s["stamped"] - TOTAL_START == 2 * (4 + STEPS - 1)
    assert s["verified_slots"] - TOTAL_START == 2 * sum(range(4, 4 + STEPS - 1))
    assert s["steps"] == (1 << 32) - 3 + STEPS and s["forwards"] == (1 << 32) - 3 + STEPS
    assert int(mgr.canaries["full"].workspace.epoch[0]) == epoch + STEPS


@pytest.mark.parametrize("epoch", EPOCHS)
def test_fault_across_the_limit_is_reported_at_its_step(epoch: int) -> None:
    fresh = make_manager(Mode.LOG)
    expected = drive(fresh, STEPS, fault_at=4)
    mgr = make_manager(Mode.LOG)
    base = (1 << 32) - 3
    start_near_limits(mgr, epoch, steps_done=base)
    reports = drive(mgr, STEPS, fault_at=4)
    hits = [i for i, r in enumerate(reports) if r is not None]
    assert hits == [i for i, r in enumerate(expected) if r is not None] and hits[0] == 5
    first, ref = reports[5], expected[5]
    assert first is not None and ref is not None
    assert first.step == base + 4 and first.reported_at == base + 5
    assert first.counts == ref.counts and first.affected_request_ids == ref.affected_request_ids
    assert mgr.stats()["violations"] == fresh.stats()["violations"] > 0
