"""Several groups' records as rows of one tensor pair (RecordRows): each group's store views its rows, and a block
move applied to all the rows at once leaves every group's records as moving them one by one does."""

from __future__ import annotations

import pytest
import torch

from kvcanary.layout import RecordRows, RecordStore

SLOTS, PAGE = 61, 4  # 15 whole blocks and a partial one


def filled(stores: list[RecordStore], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for s in stores:
        for t in s.fields():
            t.copy_(torch.randint(1, 1000, t.shape, generator=gen, dtype=t.dtype))


def fields(stores: list[RecordStore]) -> list[list[int]]:
    return [t.tolist() for s in stores for t in s.fields()]


@pytest.mark.parametrize("groups", [1, 2, 3])
def test_the_stores_are_the_rows_and_are_found_again(groups: int) -> None:
    rows = RecordRows.allocate(SLOTS, groups)
    stores = rows.stores()
    assert all(s.num_slots == SLOTS and s.tokens.is_contiguous() and s.links.is_contiguous() for s in stores)
    base = (rows.pairs.data_ptr(), rows.links.data_ptr())
    # each row at a 128-byte boundary of its allocation, as RecordStore.allocate lays its two rows out (the kernels)
    assert all((s.tokens.data_ptr() - base[0]) % 128 == 0 and (s.links.data_ptr() - base[1]) % 128 == 0 for s in stores)
    found = RecordRows.of(stores)
    assert found is not None and found.pairs.data_ptr() == rows.pairs.data_ptr() and found.num_slots == SLOTS
    stores[-1].links[3] = 7  # a write through a store is a write to its row
    assert int(found.links[groups - 1, 3]) == 7


def test_stores_not_laid_out_as_rows_are_not_joined() -> None:
    rows = RecordRows.allocate(SLOTS, 3).stores()
    assert RecordRows.of([RecordStore.allocate(SLOTS), RecordStore.allocate(SLOTS)]) is None  # two allocations
    assert RecordRows.of([rows[1], rows[0]]) is None  # out of order
    assert RecordRows.of([rows[0], rows[2]]) is None  # not consecutive
    assert RecordRows.of(rows[1:]) is not None and RecordRows.of([]) is None
    rows[2].enable_digests()  # digests are per store: not joined
    assert RecordRows.of(rows) is None and RecordRows.of(rows[:2]) is not None


@pytest.mark.parametrize("seed", range(4))
def test_a_move_of_all_rows_at_once_is_the_move_of_each_store(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    joint, single = RecordRows.allocate(SLOTS, 2), [RecordStore.allocate(SLOTS) for _ in range(2)]
    host_joint, host_single = RecordRows.allocate(7 * PAGE, 2), [RecordStore.allocate(7 * PAGE) for _ in range(2)]
    for i, group in enumerate((joint.stores(), single, host_joint.stores(), host_single)):
        filled(group, seed * 10 + i // 2)  # the joint and the single stores alike
    blocks = SLOTS // PAGE
    src = torch.randperm(blocks, generator=gen)[:5]
    dst = torch.randperm(blocks, generator=gen)[:5]
    joint.copy_blocks(src, dst, PAGE)  # a fork copy
    host = torch.randperm(7, generator=gen)[:3]
    host_joint.copy_blocks(dst[:3], host, PAGE, source=joint)  # an offload
    joint.copy_blocks(host[:2], src[:2], PAGE, source=host_joint)  # a restore
    joint.clear_blocks(dst[3:], PAGE)  # bytes of no known origin
    for s, h in zip(single, host_single, strict=True):
        s.copy_blocks(src, dst, PAGE)
        h.copy_blocks(dst[:3], host, PAGE, source=s)
        s.copy_blocks(host[:2], src[:2], PAGE, source=h)
        s.clear_blocks(dst[3:], PAGE)
    assert fields(joint.stores()) == fields(single) and fields(host_joint.stores()) == fields(host_single)
    assert fields(joint.stores())[0] != fields(joint.stores())[3]  # the groups' records differ: a real check


def test_a_manager_lays_out_groups_of_one_slot_count_as_rows_and_refuses_absurd_ones_first() -> None:
    import kvcanary as kc
    from kvcanary.runtime import CanaryManager

    caps = kc.Capacities(max_batch=4, max_tokens=64, verify_entries=256)
    groups = [
        kc.CanaryGroup(num_slots=64, name="full"),
        kc.CanaryGroup(num_slots=32, name="draft", group_id=1),
        kc.CanaryGroup(num_slots=64, name="sliding", window=8, group_id=2),
    ]
    mgr = CanaryManager(groups, caps, kc.CanaryConfig())
    stores = {name: c.records for name, c in mgr.canaries.items()}
    assert RecordRows.of([stores["full"], stores["sliding"]]) is not None  # one slot count: rows of one pair
    assert RecordRows.of([stores["full"], stores["draft"]]) is None  # the lone slot count: its own allocation
    absurd = [kc.CanaryGroup(num_slots=2**40, name=n, group_id=i) for i, n in enumerate(("a", "b"))]
    with pytest.raises(MemoryError, match=r"the records of groups \['a', 'b'\] would need"):
        CanaryManager(absurd, caps, kc.CanaryConfig())
    records = RecordRows.allocate(32, 1).stores()[0]
    with pytest.raises(ValueError, match="its records must be 64 slots"):
        kc.GroupCanary(groups[0], caps, records=records)
