"""Kernels against the reference on the same-step write checks, at awkward sizes: writers of one slot in
different work items and programs, chunks that span several stamp items, windows with a tight ring."""

from __future__ import annotations

import pytest
import torch

from kernel_compare import DEVICE
from kernel_twins import SMALL, State, Twin, World, capacities, reason_count, warm
from kvcanary.batch import StepBatch
from kvcanary.ops import launchers
from kvcanary.ops import reference as ref
from kvcanary.schema import Counter, Reason

pytestmark = pytest.mark.gpu if DEVICE.type == "cuda" else pytest.mark.interpreter


def _live_elsewhere(w: World, b) -> None:  # type: ignore[no-untyped-def]
    b.out_cache_loc[0] = w.index(2, 3)  # row 1's new token onto row 2's position 3, read this step
    b.table[1, 10] = w.index(2, 3)


def _own_earlier(w: World, b) -> None:  # type: ignore[no-untyped-def]
    b.out_cache_loc[1] = w.index(2, 0)
    b.table[2, 10] = w.index(2, 0)


def _twice(w: World, b) -> None:  # type: ignore[no-untyped-def]
    b.out_cache_loc[1] = b.out_cache_loc[0]
    b.table[2, 10] = b.out_cache_loc[0]


def _new_read(w: World, b) -> None:  # type: ignore[no-untyped-def]
    b.table[2, 10] = w.index(1, 4)


CASES = {
    "live_elsewhere": (_live_elsewhere, Reason.WRITE_INTO_LIVE_SLOT),
    "own_earlier": (_own_earlier, Reason.WRITE_INTO_LIVE_SLOT),
    "new_read": (_new_read, Reason.NEW_READ_MISMATCH),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_same_step_fault_is_caught_like_the_reference(name: str) -> None:
    fault, reason = CASES[name]
    world = World.make(rows=2, context=24, seed=len(name))
    twin = Twin(world, capacities(), SMALL)
    warm(world, twin, 10)
    batch = world.batch([(1, 10, 1), (2, 10, 1)], truth=True)
    assert reason_count(twin, reason) == 0
    fault(world, batch)
    log = twin.step(batch)
    assert log.total() > 0 and reason_count(twin, reason) > 0, f"{name}: {log.rows().tolist()}"


def _run_both(world: World, caps, batch: StepBatch, dup_slot: int):  # type: ignore[no-untyped-def]
    """Reference and kernels on one step with a slot written twice: equal except that slot's record."""
    dev_batch = batch.to(DEVICE)
    states = []
    for impl, bt, dev in ((ref, batch, torch.device("cpu")), (launchers, dev_batch, DEVICE)):
        st = State.make(world.group, caps, dev)
        kw = {"tuning": SMALL} if impl is launchers else {}
        impl.plan(st.of(world.group), bt, **kw)
        impl.verify(st.of(world.group), bt, caps.verify_entries, **kw)
        impl.stamp(st.of(world.group), bt, **kw)
        states.append(st)
    a, b = states
    for x, y in ((a.log.counters, b.log.counters), (a.log.first, b.log.first), (a.log.last, b.log.last)):
        assert torch.equal(x, y.cpu())
    assert torch.equal(a.ws.write_marks, b.ws.write_marks.cpu()) and torch.equal(a.ws.read_marks, b.ws.read_marks.cpu())
    keep = torch.ones(world.group.num_slots, dtype=torch.bool)
    keep[dup_slot] = False  # which record survives is unspecified
    assert torch.equal(a.records.links[keep], b.records.links.cpu()[keep])
    return a


def test_two_requests_writing_one_slot() -> None:
    world = World.make(rows=2, context=24, seed=4)
    batch = world.batch([(1, 0, 10), (2, 0, 10)], truth=True)
    _twice(world, batch)  # row 2's first token onto row 1's first slot, its table agreeing
    batch.table[2, 0] = batch.out_cache_loc[0]
    a = _run_both(world, capacities(), batch, int(batch.out_cache_loc[0]))
    assert int(a.log.counters[Reason.DUPLICATE_WRITE.bit_length() - 1]) == 2


def test_paged_writers_of_one_slot() -> None:
    world = World.make(rows=2, context=24, page=4, seed=3)
    batch = world.batch([(1, 0, 12), (2, 0, 12)])
    batch.out_cache_loc[12 + 2] = batch.out_cache_loc[2]  # row 2's third token onto row 1's third
    a = _run_both(world, capacities(), batch, int(batch.out_cache_loc[2]))
    assert int(a.log.counters[Reason.DUPLICATE_WRITE.bit_length() - 1]) == 2
    assert int(a.log.counters[Reason.NEW_READ_MISMATCH.bit_length() - 1]) == 1


def test_writers_of_one_slot_in_different_items_are_all_reported() -> None:
    world = World.make(rows=3, context=400, seed=5)
    caps = capacities(max_tokens=1024, verify_entries=2048, max_context=400)
    batch = world.batch([(1, 0, 300), (2, 0, 130), (3, 0, 1)])  # items of 128 tokens: 3 + 2 + 1
    for t in (7, 200, 299, 300 + 129, 430):  # rows 1, 1, 1, 2, 3 all write token 7's slot
        batch.out_cache_loc[t] = batch.out_cache_loc[7]
    a = _run_both(world, caps, batch, int(batch.out_cache_loc[7]))
    assert int(a.log.counters[Reason.DUPLICATE_WRITE.bit_length() - 1]) == 5
    assert int(a.log.counters[Counter.STAMPED]) == 431


@pytest.mark.parametrize("shape", [{"window": 5}, {"window": 5, "lookup": True}, {"window": 6, "page": 3}])
def test_clean_window_steps_stay_silent_and_identical(shape: dict[str, int]) -> None:
    world = World.make(rows=2, context=40, **shape)
    ring = shape["window"] + 1
    tight = shape.get("page", 1) == 1
    if tight:  # a tight ring: position p lives in the slot of position p % (window + 1)
        for r in (1, 2):
            base = world.table[r, :ring].clone()
            world.table[r] = base[[p % ring for p in range(world.table.shape[1])]]
    twin = Twin(world, capacities(), SMALL)
    start = ring if tight else 12
    warm(world, twin, start)
    for step in range(5):  # two-token chunks: the second token overwrites a slot the window still holds
        log = twin.step(world.batch([(1, start + 2 * step, 2), (2, start + 2 * step, 2)], truth=True))
        assert log.total() == 0, log.rows().tolist()
    assert int(twin.ref.log.counters[Counter.VERIFIED]) > 0
