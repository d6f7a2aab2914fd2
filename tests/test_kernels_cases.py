"""Kernels vs reference on hand-made multi-step cases: clean runs, one fault at a time, log overflow,
long chunks, empty batches, rewrites, host-side refusals.

Every step runs both implementations phase by phase and compares every output exactly; each fault
test also asserts the reason it must raise (and the clean steps before it stay silent).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from kernel_compare import DEVICE
from kernel_twins import FUSING, SMALL, State, Twin, World, capacities, reason_count, warm
from kvcanary import Backend, CanaryGroup, GroupCanary, StepBatch
from kvcanary.layout import RecordStore
from kvcanary.ops import launchers
from kvcanary.ops import reference as ref
from kvcanary.schema import NOT_STORED, Counter, Reason
from kvcanary.workspace import GroupState, PlanWorkspace

pytestmark = pytest.mark.gpu if DEVICE.type == "cuda" else pytest.mark.interpreter

# --------------------------------------------------------------------------- clean runs


@pytest.mark.parametrize(
    "shape",
    [
        {},
        {"page": 4},
        {"window": 5, "lookup": True},
        {"window": 7},
        {"token_offset": 1},
    ],
    ids=["token-table", "paged", "window-lookup", "window", "draft"],
)
def test_clean_steps_are_silent_and_identical(shape: dict[str, int]) -> None:
    world = World.make(rows=3, context=40, **shape)
    twin = Twin(world, capacities(), SMALL)
    warm(world, twin, 20)
    for step in range(6):  # decode, one padding row, ground truth every other step
        log = twin.step(world.batch([(r, 20 + step, 1) for r in (1, 2, 3)], truth=step % 2 == 0, pad_rows=1))
        assert log.total() == 0, log.rows().tolist()
    assert int(twin.ref.log.counters[Counter.VERIFIED]) > 0


def test_group_canary_dispatches_to_kernels() -> None:
    world = World.make(rows=2, context=16)
    caps = capacities()
    kern = GroupCanary(world.group, caps, device=DEVICE, backend=Backend.TRITON)
    base = GroupCanary(world.group, caps, backend=Backend.REFERENCE)
    klog, blog = kern.new_log(), base.new_log()
    for p, e in ((0, 6), (6, 1), (7, 1)):
        batch = world.batch([(1, p, e), (2, p, e)])
        base.step(batch, blog)
        kern.step(batch.to(DEVICE), klog)
    assert torch.equal(kern.records.links.cpu(), base.records.links)
    assert torch.equal(klog.counters.cpu(), blog.counters)


def test_long_chunks_stamp_in_parallel_like_the_reference() -> None:
    """Chunks spanning many items: each item adds the row's earlier tokens (its carry) to its own scan."""
    world = World.make(rows=2, context=1100)
    twin = Twin(world, capacities(max_tokens=2048, verify_entries=4096, max_context=1100), SMALL)
    assert twin.step(world.batch([(1, 0, 700), (2, 0, 333)])).total() == 0
    assert twin.step(world.batch([(1, 700, 390), (2, 333, 1)])).total() == 0
    assert twin.step(world.batch([(1, 1090, 1), (2, 334, 1)])).total() == 0


def test_empty_batch_and_idle_rows() -> None:
    world = World.make(rows=2, context=16)
    twin = Twin(world, capacities())
    empty = world.batch([])
    assert empty.batch_size == 0
    assert twin.step(empty).total() == 0
    warm(world, twin, 6)
    assert twin.step(world.batch([(1, 6, 0), (2, 6, 0)])).total() == 0  # verify only, nothing written
    assert int(twin.ref.log.counters[Counter.CALLS]) == 4 * 3


# --------------------------------------------------------------------------- one fault at a time


def _fault_table_elsewhere(w: World, b: StepBatch) -> None:
    b.table[1, 3] = b.table[2, 3]


def _fault_table_negative(w: World, b: StepBatch) -> None:
    b.table[1, 2] = -5


def _fault_table_huge(w: World, b: StepBatch) -> None:
    b.table = b.table.to(torch.int64)
    b.table[2, 4] = 2**62


def _fault_table_reserved(w: World, b: StepBatch) -> None:
    b.table[1, 5] = 0


def _fault_seed_out_of_range(w: World, b: StepBatch) -> None:
    b.table = b.table.to(torch.int64)
    b.table[1, 9] = -(2**40)  # prefix 10: the seed sits at position 9


def _fault_row_out_of_range(w: World, b: StepBatch) -> None:
    b.rows[0] = 77


def _fault_negative_row(w: World, b: StepBatch) -> None:
    b.rows[1] = -3


def _fault_length_huge(w: World, b: StepBatch) -> None:
    b.prefix_lens = b.prefix_lens.to(torch.int64)
    b.extend_lens = b.extend_lens.to(torch.int64)
    b.prefix_lens[0] = 2**63 - 1  # prefix + extend wraps int64


def _fault_extend_huge(w: World, b: StepBatch) -> None:
    b.extend_lens = b.extend_lens.to(torch.int64)
    b.extend_lens[0] = 2**63 - 1  # the row sums would wrap


def _fault_negative_prefix(w: World, b: StepBatch) -> None:
    b.prefix_lens[1] = -1


def _fault_write_position(w: World, b: StepBatch) -> None:
    b.positions[1] += 1


def _fault_write_token(w: World, b: StepBatch) -> None:
    b.input_ids[0] += 1


def _fault_out_loc_reserved(w: World, b: StepBatch) -> None:
    b.out_cache_loc[0] = 0


def _fault_out_loc_huge(w: World, b: StepBatch) -> None:
    b.out_cache_loc[1] = 2**50


def _fault_truth_lens_huge(w: World, b: StepBatch) -> None:
    b.truth_lens = b.truth_lens.to(torch.int64)  # type: ignore[union-attr]
    b.truth_lens[0] = 2**62  # type: ignore[index]
    b.truth[1, 3] += 1  # type: ignore[index]


FAULTS = {
    "table_elsewhere": (_fault_table_elsewhere, Reason.LINK_MISMATCH),
    "table_negative": (_fault_table_negative, Reason.SLOT_OUT_OF_RANGE),
    "table_huge": (_fault_table_huge, Reason.SLOT_OUT_OF_RANGE),
    "table_reserved": (_fault_table_reserved, Reason.RESERVED_SLOT),
    "seed_out_of_range": (_fault_seed_out_of_range, Reason.SEED_OUT_OF_RANGE),
    "row_out_of_range": (_fault_row_out_of_range, Reason.ROW_OUT_OF_RANGE),
    "negative_row": (_fault_negative_row, Reason.ROW_OUT_OF_RANGE),
    "length_huge": (_fault_length_huge, Reason.LENGTH_OUT_OF_RANGE),
    "extend_huge": (_fault_extend_huge, Reason.LENGTH_OUT_OF_RANGE),
    "negative_prefix": (_fault_negative_prefix, Reason.LENGTH_OUT_OF_RANGE),
    "write_position": (_fault_write_position, Reason.WRITE_POSITION_MISMATCH),
    "write_token": (_fault_write_token, Reason.WRITE_TOKEN_MISMATCH),
    "out_loc_reserved": (_fault_out_loc_reserved, Reason.RESERVED_SLOT),
    "out_loc_huge": (_fault_out_loc_huge, Reason.SLOT_OUT_OF_RANGE),
    "truth_lens_huge": (_fault_truth_lens_huge, Reason.TOKEN_MISMATCH),
}


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_fault_is_caught_like_the_reference(name: str) -> None:
    fault, reason = FAULTS[name]
    world = World.make(rows=2, context=24, seed=len(name))
    twin = Twin(world, capacities())
    warm(world, twin, 10)
    batch = world.batch([(1, 10, 1), (2, 10, 1)], truth=True)
    fault(world, batch)
    log = twin.step(batch)
    assert log.total() > 0 and reason_count(twin, reason) > 0, f"{name}: {log.rows().tolist()}"


def test_record_faults_in_verify() -> None:
    world = World.make(rows=2, context=24)
    twin = Twin(world, capacities())
    warm(world, twin, 12)
    for st in (twin.ref, twin.dev):  # never written, wrong token, wrong position
        st.records.links[world.index(1, 4)] = 0
        st.records.tokens[world.index(2, 7)] += 1
        st.records.positions[world.index(2, 9)] += 3
    log = twin.step(world.batch([(1, 12, 1), (2, 12, 1)], truth=True))
    for reason in (Reason.NEVER_WRITTEN, Reason.TOKEN_MISMATCH, Reason.POSITION_MISMATCH, Reason.LINK_MISMATCH):
        assert reason_count(twin, reason) > 0, (reason, log.rows().tolist())


def test_window_lookup_faults() -> None:
    world = World.make(rows=2, context=32, window=6, lookup=True)
    twin = Twin(world, capacities())
    warm(world, twin, 16)
    batch = world.batch([(1, 16, 1), (2, 16, 1)])
    batch.lookup[world.index(1, 13)] = 10**6  # type: ignore[index]  # lookup entry beyond the pool
    batch.table[2, 14] = len(world.lookup) + 3  # type: ignore[arg-type]  # table index beyond the lookup
    twin.step(batch)
    assert reason_count(twin, Reason.SLOT_OUT_OF_RANGE) > 0
    assert reason_count(twin, Reason.LOOKUP_OUT_OF_RANGE) > 0


def test_not_stored_tokens_advance_the_chain_silently() -> None:
    world = World.make(rows=2, context=16)
    twin = Twin(world, capacities())
    warm(world, twin, 4)
    batch = world.batch([(1, 4, 2), (2, 4, 2)])
    batch.out_cache_loc[2] = NOT_STORED
    assert twin.step(batch).total() == 0
    assert int(twin.ref.log.counters[Counter.STAMPED]) == 8 + 3


def test_verify_capacity_overflow_is_partial_and_counted() -> None:
    world = World.make(rows=3, context=40)
    twin = Twin(world, capacities(verify_entries=50, max_context=20), SMALL)
    warm(world, twin, 20)  # the second warm-up step plans 30 entries: fits
    twin.step(world.batch([(1, 20, 1), (2, 20, 1), (3, 20, 1)]))  # 60 planned, 50 verified
    assert int(twin.ref.log.counters[Counter.SKIPPED]) == 10


# --------------------------------------------------------------------------- the log


@pytest.mark.parametrize("log_rows", [1, 2, 3, 8])
def test_many_violations_keep_first_and_last_rows(log_rows: int) -> None:
    """Hundreds of rows over many items and programs: first K and last K land where the reference puts them."""
    world = World.make(rows=4, context=200)
    twin = Twin(world, capacities(max_tokens=512, verify_entries=1024, max_context=200, log_rows=log_rows), SMALL)
    warm(world, twin, 150)
    for st in (twin.ref, twin.dev):
        st.records.links[1::3] = 0  # every third slot looks never written
        st.records.tokens[2::7] += 1
    batch = world.batch([(r, 150, 3) for r in (1, 2, 3, 4)], truth=True)
    batch.positions[::2] += 1
    log = twin.step(batch)
    assert log.total() > 4 * log_rows
    twin.step(world.batch([(r, 153, 1) for r in (1, 2, 3, 4)]))  # a second step continues the lifetime count


def test_slot_written_twice_holds_one_of_the_writes() -> None:
    world = World.make(rows=2, context=16)
    caps = capacities()
    ref_state, dev_state = State.make(world.group, caps, torch.device("cpu")), State.make(world.group, caps, DEVICE)
    batch = world.batch([(1, 0, 3), (2, 0, 3)])
    batch.out_cache_loc[4] = batch.out_cache_loc[1]
    dev_batch = batch.to(DEVICE)
    for impl, st, bt in ((ref, ref_state, batch), (launchers, dev_state, dev_batch)):
        impl.plan(st.of(world.group), bt)
        impl.stamp(st.of(world.group), bt)
    slot = int(batch.out_cache_loc[1])
    keep = torch.ones(world.group.num_slots, dtype=torch.bool)
    keep[slot] = False
    assert torch.equal(ref_state.records.links[keep], dev_state.records.links.cpu()[keep])
    assert torch.equal(ref_state.log.counters, dev_state.log.counters.cpu())
    writes = {(int(batch.input_ids[t]), int(batch.positions[t])) for t in (1, 4)}
    got = (int(dev_state.records.tokens[slot]), int(dev_state.records.positions[slot]))
    assert got[0] in {w[0] for w in writes} and got[1] in {w[1] for w in writes}


# --------------------------------------------------------------------------- host-side refusals


def test_launchers_refuse_bad_metadata_before_running() -> None:
    world = World.make(rows=2, context=16)
    caps = capacities()
    st = State.make(world.group, caps, DEVICE)
    batch = world.batch([(1, 0, 2)])
    batch = batch.to(DEVICE)
    counters = st.log.counters.clone()
    bad_records = RecordStore(st.records.tokens.long(), st.records.positions, st.records.links)
    with pytest.raises(TypeError, match=r"records\.tokens"):
        launchers.plan(GroupState(world.group, bad_records, st.ws, st.log), batch)
    with pytest.raises(ValueError, match="capacity"):
        launchers.verify(st.of(world.group), batch, 10**9)
    with pytest.raises(ValueError, match="capacity"):
        launchers.verify(st.of(world.group), batch, 0)
    with pytest.raises(ValueError, match="capacity"):
        launchers.plan_verify(st.of(world.group), batch, 10**9)
    short = dataclasses.replace(batch, positions=batch.positions[:1])
    with pytest.raises(ValueError, match="positions"):
        launchers.stamp(st.of(world.group), short)
    with pytest.raises(ValueError, match="verify_block"):
        launchers.KernelTuning(verify_block=100)
    assert torch.equal(st.log.counters, counters)


def test_plan_and_verify_share_a_launch_only_for_small_workspaces() -> None:
    """A static choice from the capacities: small workspaces fuse, large ones (or fuse_max_batch=0) don't."""
    group = CanaryGroup(num_slots=64)

    def fuses(max_batch: int, tuning: launchers.KernelTuning = FUSING) -> bool:
        caps = capacities(max_batch=max_batch)
        ws = PlanWorkspace.allocate(caps, DEVICE, num_slots=group.num_slots)
        return launchers.fuses_plan(group, ws, caps.verify_entries, tuning)

    assert fuses(8) and fuses(32)
    assert fuses(8, launchers.DEFAULT_TUNING) and not fuses(9, launchers.DEFAULT_TUNING)  # the default: 8 rows
    assert not fuses(8, launchers.KernelTuning(fuse_max_batch=0))
    assert not fuses(33)
    with pytest.raises(ValueError, match="fuse_max_batch"):
        launchers.KernelTuning(fuse_max_batch=-1)
