"""A restore's writes, and a fork's copies, mirrored as one (the hybrid model: one write a group): the records
end as the writes mirrored one by one leave them, in fewer device ops, and every write the join would misorder or
mislabel is left to the one-by-one path."""

from __future__ import annotations

import dataclasses
import time
import types

import pytest
import torch

import compiled_build
from kvcanary.adapters.transformers_cb import byte_moves, mirror
from kvcanary.layout import RecordRows
from test_adapter_transformers_mirror import (
    BYTES_PER_BLOCK,
    CountedOps,
    allocator,
    engine_offload,
    engine_restore,
    links,
    two_groups,
)
from transformers_helpers import PAGE, geometry

NAMES = ("a", "b")
HOST_BLOCKS = 8


def observed_restore(read: list[list[int]], into: list[list[int]]) -> list[byte_moves.BlockWrite]:
    """The writes of one restore as the engine makes it on the hybrid model: host blocks ``read[k]`` into device blocks
    ``into[k]``, one write for each k (each group's allocator), both groups' views over one cache tensor."""
    g = geometry()
    a = allocator(g)
    pool = torch.zeros(HOST_BLOCKS * BYTES_PER_BLOCK, dtype=torch.uint8)
    views = dict.fromkeys(NAMES, byte_moves.block_view(a))
    with byte_moves.BlockWriteObserver(byte_moves.watch(views), host_pool=pool) as seen:
        for cpu, gpu in zip(read, into, strict=True):
            engine_restore(a, pool, cpu, gpu)
    return seen.writes


def saved_rows(blocks: list[int], hosts: list[int]) -> tuple[RecordRows, mirror.HostRecords]:
    """Both groups' records stamped on ``blocks``, offloaded into ``hosts`` as rows, the device records then
    cleared: what a restore brings back is only what the host records hold."""
    g = geometry()
    rows, _ = two_groups(g, blocks)
    host = mirror.HostRecords()
    saves = [byte_moves.HostSave(NAMES, tuple(hosts), torch.tensor(blocks))]
    assert host.save_all_rows(NAMES, PAGE, rows, saves, HOST_BLOCKS, mirror.MoveIndex())
    for t in (rows.pairs, rows.links):
        t.zero_()
    return rows, host


def restored(read: list[list[int]], into: list[list[int]], joined: bool) -> tuple[list[list[list[int]]], int]:
    """Each group's links on every written block after restoring ``read`` into ``into`` (the device blocks 1-4 were
    offloaded into host blocks 4-7), joined or write by write, and the record writes the mirror made."""
    rows, host = saved_rows([1, 2, 3, 4], [4, 5, 6, 7])
    writes = observed_restore(read, into)
    with CountedOps() as counted:
        if joined:
            assert host.restore_joined(NAMES, PAGE, rows, writes, mirror.MoveIndex())
        else:
            for write in writes:
                assert host.restore_rows(NAMES, PAGE, rows, write, mirror.MoveIndex())
    g = geometry()
    blocks = sorted({b for gpu in into for b in gpu})
    return [[links(g, rec, b) for b in blocks] for rec in rows.stores()], counted.index_puts


def test_the_observer_knows_the_values_of_index_tensors_built_from_host_lists() -> None:
    pool = torch.zeros(4, dtype=torch.uint8)
    with byte_moves.BlockWriteObserver({}, host_pool=pool) as seen:
        made = torch.tensor([3, 1, 4, 1, 5])
        moved = torch.as_tensor([9, 2, 6], dtype=torch.long).to(torch.float64).to(torch.int64)
        part = made[1:4]
        computed = made + 1
        copied = made.clone()
    assert seen.values(made) == (3, 1, 4, 1, 5) and seen.values(moved) == (9, 2, 6)
    assert seen.values(part) == (1, 4, 1)
    assert seen.values(computed) is None and seen.values(copied) is None  # made by device work: not known
    assert seen.values(torch.tensor([3, 1, 4, 1, 5])) is None  # built outside the move


def test_the_observer_times_its_own_work_not_the_calls_it_watches() -> None:
    """Its own time is what the canary adds to a move (counted with the mirror's): it grows with the calls it keeps
    and leaves out the engine's calls themselves, however long they run."""
    pool = torch.zeros(4, dtype=torch.uint8)
    slow = torch.ones(4096, 4096)
    with byte_moves.BlockWriteObserver({}, host_pool=pool) as idle:
        pass
    assert idle.own_ns == 0
    with byte_moves.BlockWriteObserver({}, host_pool=pool) as seen:
        start = time.perf_counter_ns()
        for _ in range(3):
            slow.mul_(1.0)  # a call it sees but keeps nothing of
        engine_ns = time.perf_counter_ns() - start
        torch.tensor([3, 1, 4])  # one it keeps the values of
    assert 0 < seen.own_ns < engine_ns / 10


def test_a_restore_write_carries_its_destination_blocks_from_the_engine_list() -> None:
    writes = observed_restore([[5, 4], [7]], [[9, 8], [11]])
    assert [w.dest_values for w in writes] == [(9, 8), (11,)]
    assert [w.source_host_blocks for w in writes] == [(5, 4), (7,)]


def test_a_joined_restore_leaves_the_records_as_the_writes_one_by_one_in_half_the_writes() -> None:
    read, into = [[5, 4], [7, 6]], [[9, 8], [11, 10]]  # host blocks out of order: gathered through an index
    got, joined_puts = restored(read, into, joined=True)
    want, one_by_one_puts = restored(read, into, joined=False)
    assert got == want and joined_puts * 2 == one_by_one_puts
    g, fresh = geometry(), two_groups(geometry(), [1, 2, 3, 4])[0].stores()
    assert got == [[links(g, rec, b) for b in (1, 2, 3, 4)] for rec in fresh]  # blocks 8-11 <- hosts 4-7 <- 1-4
    assert got[0] != got[1]
    # Host block 0 was never saved (within the host records, no record there): its block gets none either way.
    got, _ = restored([[4], [0]], [[8], [9]], joined=True)
    assert got == restored([[4], [0]], [[8], [9]], joined=False)[0] and got[0][1] == [0] * PAGE != got[0][0]


@pytest.mark.parametrize(
    ("case", "read", "into"),
    [
        ("a block written twice", [[4], [5]], [[9], [9]]),  # the later write's bytes stay: one scatter would not order
        ("one write", [[4, 5]], [[8, 9]]),
    ],
)
def test_writes_the_join_would_misorder_are_mirrored_one_by_one(
    case: str, read: list[list[int]], into: list[list[int]]
) -> None:
    rows, host = saved_rows([1, 2, 3, 4], [4, 5, 6, 7])
    writes = observed_restore(read, into)
    assert mirror.joined_restore(writes, NAMES, HOST_BLOCKS) is None, case
    assert not host.restore_joined(NAMES, PAGE, rows, writes, mirror.MoveIndex())
    assert int(rows.links.count_nonzero()) == 0  # nothing done: the caller mirrors the writes one by one


def test_writes_of_unknown_destination_or_source_or_other_groups_are_not_joined() -> None:
    writes = observed_restore([[4], [5]], [[8], [9]])
    assert mirror.joined_restore(writes, NAMES, HOST_BLOCKS) is not None
    no_values = [dataclasses.replace(w, dest_values=None) for w in writes]
    assert mirror.joined_restore(no_values, NAMES, HOST_BLOCKS) is None  # the destination not built from a list
    unknown = [writes[0], dataclasses.replace(writes[1], source_host_blocks=(-1,))]
    assert mirror.joined_restore(unknown, NAMES, HOST_BLOCKS) is None  # a row of no known host block
    assert mirror.joined_restore(writes, NAMES, 5) is None  # host block 5 past the host records
    other = [writes[0], dataclasses.replace(writes[1], groups=("a",))]
    assert mirror.joined_restore(other, NAMES, HOST_BLOCKS) is None


@compiled_build.patches("kvcanary.adapters.transformers_cb.bulk_moves")  # a stand-in binding
def test_the_restore_wrapper_joins_the_writes_and_the_records_follow_the_bytes() -> None:
    """Through the adapter's wrapper (the engine's restore under the observer, then the mirror): a restore that reads
    the wrong host blocks brings their records along, joined as one by one."""
    from kvcanary.adapters.transformers_cb.bulk_moves import _restore_joined

    rows, host = saved_rows([1, 2, 3, 4], [4, 5, 6, 7])
    geometries = {n: dataclasses.replace(geometry(), name=n) for n in NAMES}
    binding = types.SimpleNamespace(
        rows=lambda names: rows if names == NAMES else None, geometries=geometries, host=host
    )
    writes = observed_restore([[5], [4]], [[8], [9]])  # swapped: block 8 gets host 5's (device block 2's) records
    assert _restore_joined(binding, writes, mirror.MoveIndex())  # type: ignore[arg-type]
    g, fresh = geometry(), two_groups(geometry(), [1, 2, 3, 4])[0].stores()
    assert [links(g, rows.stores()[0], b) for b in (8, 9)] == [links(g, fresh[0], b) for b in (2, 1)]


def test_an_offload_observed_with_values_still_saves_by_the_bytes() -> None:
    """The values the observer keeps change nothing about what an offload saves (the host blocks its copies landed
    in, from the blocks its gather read)."""
    g = geometry()
    a = allocator(g)
    pool = torch.zeros(HOST_BLOCKS * BYTES_PER_BLOCK, dtype=torch.uint8)
    with byte_moves.BlockWriteObserver(byte_moves.watch({"a": byte_moves.block_view(a)}), host_pool=pool) as seen:
        engine_offload(a, pool, [1, 3], [6, 4])
    assert [(s.host_blocks, s.source_blocks.tolist()) for s in seen.host_saves] == [((6,), [1]), ((4,), [3])]  # type: ignore[union-attr]


def observed_copies(copies: list[tuple[str, list[int], list[int]]]) -> list[tuple[str, byte_moves.BlockWrite]]:
    """A fork's copies as the engine makes them: one ``copy_blocks`` a group (``(group, sources, destinations)``),
    each observed by its own group's wrapper, over one cache tensor."""
    a = allocator(geometry())
    out = []
    for name, src, dst in copies:
        with byte_moves.BlockWriteObserver(byte_moves.watch({name: byte_moves.block_view(a)})) as seen:
            source, dest = torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long)
            a._copy_view.index_copy_(0, dest[0 : len(dst)], a._copy_view.index_select(0, source[0 : len(src)]))
        out += [(name, w) for w in seen.writes]
    return out


def test_a_fork_copy_write_carries_its_blocks_from_the_engine_lists() -> None:
    ((_, write),) = observed_copies([("a", [1, 3], [6, 7])])
    assert (write.source_values, write.dest_values) == ((1, 3), (6, 7))


@pytest.mark.parametrize(
    ("copies", "joins"),
    [
        ([("a", [1, 3], [6, 7]), ("b", [2], [8])], True),
        ([("a", [1], [6]), ("b", [6], [8])], False),  # the second reads what the first wrote
        ([("a", [1], [6]), ("b", [2], [6])], False),  # one block written twice: the last write's bytes stay
        ([("a", [1, 2], [6, 6])], False),
        ([("a", [1], [6])], False),  # one write: nothing to join
        ([("a", [1], [6]), ("b", [6], [1])], False),
    ],
)
def test_fork_copies_join_only_where_one_gather_and_one_write_order_them_alike(
    copies: list[tuple[str, list[int], list[int]]], joins: bool
) -> None:
    assert mirror.joined_copy([w for _, w in observed_copies(copies)]) is joins


@compiled_build.patches("kvcanary.adapters.transformers_cb.bulk_moves")  # a stand-in binding
def test_joined_fork_copies_leave_each_group_the_records_its_own_copy_would() -> None:
    """Joined, the groups' copies land in both groups' rows: each group's records of its own destinations are what its
    copy alone leaves; the other group's records of those blocks (a block is one group's at a time) are its own
    records of the sources, never read before that group writes the block."""
    from kvcanary.adapters.transformers_cb.bulk_moves import _mirror_copies

    g = geometry()
    copies = [("a", [1, 3], [6, 7]), ("b", [2], [8])]
    forks = observed_copies(copies)
    rows, single = two_groups(g, [1, 2, 3])
    binding = types.SimpleNamespace(
        rows=lambda names: rows if names == NAMES else None,
        geometries={n: dataclasses.replace(g, name=n) for n in NAMES},
        records=lambda name: rows.stores()[NAMES.index(name)],
        moves=None,  # mirrored at once (the CPU's way)
    )
    with CountedOps() as joined:
        _mirror_copies(binding, forks)  # type: ignore[arg-type]
    with CountedOps() as one_by_one:
        for name, write in forks:
            mirror.apply_block_write(g, single[NAMES.index(name)], write)
    stores = rows.stores()
    for name, _, dst in copies:
        k = NAMES.index(name)
        assert [links(g, stores[k], b) for b in dst] == [links(g, single[k], b) for b in dst] != [[0] * PAGE] * len(dst)
    assert [links(g, stores[1], b) for b in (6, 7)] == [links(g, single[1], b) for b in (1, 3)]
    assert joined.index_puts * 2 == one_by_one.index_puts


def test_an_offload_of_two_gathers_is_saved_through_one_index_as_through_their_tensors() -> None:
    """The hybrid model's offload gathers once a group and copies runs of each gather into host rows: the sources known
    as host numbers, both ends go in one index (no join of the engine's tensors), and the host records end alike."""
    g = geometry()
    a = allocator(g)
    pool = torch.zeros(HOST_BLOCKS * BYTES_PER_BLOCK, dtype=torch.uint8)
    with byte_moves.BlockWriteObserver(byte_moves.watch(dict.fromkeys(NAMES, byte_moves.block_view(a))), pool) as seen:
        engine_offload(a, pool, [3, 1], [6, 4])
        engine_offload(a, pool, [2], [7])
    assert [s.source_values for s in seen.host_saves] == [(3,), (1,), (2,)]
    unknown = [dataclasses.replace(s, source_values=None) for s in seen.host_saves]
    host_links = []
    for saves, joins in ((seen.host_saves, 0), (unknown, 1)):
        rows, _ = two_groups(g, [1, 2, 3])
        host = mirror.HostRecords()
        with CountedOps() as counted:
            assert host.save_all_rows(NAMES, PAGE, rows, saves, HOST_BLOCKS, mirror.MoveIndex())
        assert counted.names.count("aten.cat.default") == joins  # the engine's tensors joined only when not known
        back, _ = two_groups(g, [])
        for t in (back.pairs, back.links):
            t.zero_()
        restore = byte_moves.BlockWrite(NAMES, torch.tensor([9, 10, 11]), None, (6, 4, 7))
        assert host.restore_rows(NAMES, PAGE, back, restore, mirror.MoveIndex())
        host_links.append([[links(g, rec, b) for b in (9, 10, 11)] for rec in back.stores()])
    fresh = two_groups(g, [1, 2, 3])[0].stores()
    assert host_links[0] == host_links[1] == [[links(g, rec, b) for b in (3, 1, 2)] for rec in fresh]
