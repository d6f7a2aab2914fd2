"""The records follow the engine's block writes (byte_moves + mirror), not its bookkeeping: both sides."""

from __future__ import annotations

import types

import torch

from kvcanary.adapters.transformers_cb import byte_moves, mirror
from kvcanary.adapters.transformers_cb.geometry import GroupGeometry
from kvcanary.layout import RecordStore

PAGE, STRIDE, BPS, BYTES_PER_BLOCK = 4, 8, 2, 16
NAME = "full_attention"


def geometry() -> GroupGeometry:
    return GroupGeometry(
        name=NAME,
        index=0,
        sliding_window=0,
        page_size=PAGE,
        stride=STRIDE,
        num_blocks=BPS * 6,
        read_trash_index=0,
        sentinel_index=1,
        write_trash_index=STRIDE * BPS,
    )


def allocator(g: GroupGeometry) -> types.SimpleNamespace:
    """Stands in for a transformers allocator: a typed cache tensor and the engine's byte view of it."""
    cache = torch.zeros(g.num_blocks * BYTES_PER_BLOCK // 2, dtype=torch.float16)
    a = types.SimpleNamespace(cache_tensor=cache, bytes_per_block=BYTES_PER_BLOCK)
    a._copy_view = cache.view(torch.uint8).view(-1, BYTES_PER_BLOCK)
    return a


def stamped(g: GroupGeometry, blocks: list[int]) -> RecordStore:
    rec = RecordStore.allocate(g.num_slots)
    for b in blocks:
        slots = g.block_slots(torch.tensor([b]))
        rec.links[slots] = torch.arange(1, 2 * PAGE, 2) + 100 * b  # odd, distinct per block
        rec.positions[slots] = torch.arange(PAGE, dtype=torch.int32) + PAGE * b
    return rec


def links(g: GroupGeometry, rec: RecordStore, block: int) -> list[int]:
    return [int(x) for x in rec.links[g.block_slots(torch.tensor([block]))]]


def engine_copy(view: torch.Tensor, src: list[int], dst: list[int]) -> None:
    view.index_copy_(0, torch.tensor(dst), view.index_select(0, torch.tensor(src)))


def test_a_copy_that_lands_moves_the_records_and_one_that_misses_the_cache_does_not() -> None:
    g = geometry()
    a = allocator(g)
    for lands in (True, False):
        rec = stamped(g, [4])
        view = a._copy_view if lands else a._copy_view.clone()  # the lost copy writes a buffer nobody reads
        with byte_moves.BlockWriteObserver({NAME: byte_moves.block_view(a)}) as seen:
            engine_copy(view, [4], [7])
        for w in seen.writes:
            mirror.apply_block_write(g, rec, w)
        assert links(g, rec, 7) == (links(g, rec, 4) if lands else [0] * PAGE)
        assert len(seen.writes) == int(lands)


def test_a_write_of_unknown_origin_leaves_its_blocks_without_records() -> None:
    g = geometry()
    a = allocator(g)
    rec = stamped(g, [3, 5])
    with byte_moves.BlockWriteObserver({NAME: byte_moves.block_view(a)}) as seen:
        a._copy_view.index_copy_(0, torch.tensor([5]), torch.ones(1, BYTES_PER_BLOCK, dtype=torch.uint8))
    for w in seen.writes:
        mirror.apply_block_write(g, rec, w)
    assert links(g, rec, 5) == [0] * PAGE and links(g, rec, 3) != [0] * PAGE


def test_a_restore_puts_the_saved_pages_where_its_write_lands() -> None:
    """Right restore: pages land in the new table.  Misdirected restore: page k lands in block k+1, and
    the records say so, so reading the table finds other positions."""
    g = geometry()
    a = allocator(g)
    new_table = [8, 9, 10]
    for misdirect in (False, True):
        rec = stamped(g, [2, 3, 4])
        shadow = mirror.OffloadShadow()
        shadow.save("r", g, rec, [2, 3, 4])
        shadow.save("s", g, rec, [2])
        rec.clear_slots(torch.arange(g.num_slots))
        dest = new_table[1:] + new_table[:1] if misdirect else new_table
        staging = torch.zeros(4, BYTES_PER_BLOCK, dtype=torch.uint8)
        with byte_moves.BlockWriteObserver({NAME: byte_moves.block_view(a)}) as seen:
            a._copy_view.index_copy_(0, torch.tensor([*dest, 11]), staging)  # "s" resumes on block 11
        tables = {"r": {NAME: 3}, "s": {NAME: 1}}
        mirror.restore_observed(shadow, ["r", "s"], tables, {NAME: g}, {NAME: rec}, seen.writes)
        original = stamped(g, [2, 3, 4])
        for k, block in enumerate(new_table):
            want = links(g, original, [2, 3, 4][(k - 1) % 3 if misdirect else k])
            assert links(g, rec, block) == want
        assert links(g, rec, 11) == links(g, original, 2)
        assert len(shadow) == 0


def test_a_restore_whose_write_does_not_match_the_saved_pages_restores_nothing() -> None:
    g = geometry()
    a = allocator(g)
    for n_written in (2, 0):  # one page short, or no write into the cache at all
        rec = stamped(g, [2, 3])
        shadow = mirror.OffloadShadow()
        shadow.save("r", g, rec, [2, 3])
        rec.clear_slots(torch.arange(g.num_slots))
        with byte_moves.BlockWriteObserver({NAME: byte_moves.block_view(a)}) as seen:
            if n_written:
                a._copy_view.index_copy_(0, torch.tensor([8]), torch.zeros(1, BYTES_PER_BLOCK, dtype=torch.uint8))
        mirror.restore_observed(shadow, ["r"], {"r": {NAME: 2}}, {NAME: g}, {NAME: rec}, seen.writes)
        assert int(rec.links.count_nonzero()) == 0 and "r" not in shadow
