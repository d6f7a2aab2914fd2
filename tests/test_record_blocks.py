"""RecordStore's moves of whole blocks against the per-slot moves they replace (random, awkward page sizes)."""

from __future__ import annotations

import pytest
import torch

from kvcanary.layout import RecordStore


def filled(num_slots: int, seed: int, digests: bool) -> RecordStore:
    g = torch.Generator().manual_seed(seed)
    rec = RecordStore.allocate(num_slots)
    if digests:
        rec.enable_digests()
    for t in rec.fields():
        t.copy_(torch.randint(-(2**31), 2**31 - 1, (num_slots,), generator=g, dtype=t.dtype))
    return rec


def slots(blocks: torch.Tensor, page: int) -> torch.Tensor:
    return (blocks.reshape(-1, 1) * page + torch.arange(page)).reshape(-1)


@pytest.mark.parametrize("page", [1, 3, 7, 16])
@pytest.mark.parametrize("digests", [False, True])
def test_block_moves_match_the_slot_moves(page: int, digests: bool) -> None:
    blocks = 11
    num_slots = blocks * page + 1  # a reserved slot past the last whole block, as the adapters lay them out
    g = torch.Generator().manual_seed(page)
    for trial in range(4):
        src = torch.randperm(blocks, generator=g)[: 1 + trial * 2]
        dst = torch.randperm(blocks, generator=g)[: src.numel()]  # distinct destinations, may overlap the sources
        mine, spec = filled(num_slots, trial, digests), filled(num_slots, trial, digests)
        other, other_spec = filled(blocks * page, 100 + trial, digests), filled(blocks * page, 100 + trial, digests)
        mine.copy_blocks(src, dst, page)
        for t in spec.fields():  # the per-slot move the block move replaces: sources read before any write
            t[slots(dst, page)] = t[slots(src, page)]
        mine.copy_blocks(src, dst, page, source=other)  # from another store (the host pool's)
        for to, of in zip(spec.fields(), other_spec.fields(), strict=True):
            to[slots(dst, page)] = of[slots(src, page)]
        mine.clear_blocks(src[:1], page)
        spec.clear_slots(slots(src[:1], page))
        for a, b in zip(mine.fields(), spec.fields(), strict=True):
            assert torch.equal(a, b)


def test_tokens_and_positions_move_as_one_and_stores_laid_out_otherwise_still_exchange_blocks() -> None:
    rec = filled(9, 0, digests=True)
    assert [v.shape for v in rec.blocks(4)] == [(2, 2, 4), (1, 2, 4), (1, 2, 4)]  # tokens+positions, links, digests
    assert rec.positions.data_ptr() - rec.tokens.data_ptr() == 128  # each row at a 128-byte boundary
    apart = RecordStore(rec.tokens.clone(), rec.positions.clone(), rec.links.clone(), rec.digests.clone())
    assert [v.shape[0] for v in apart.blocks(4)] == [1, 1, 1, 1]  # fields of their own: one view each
    spec = filled(9, 0, digests=True)
    other = filled(9, 5, digests=True)
    apart.copy_blocks(torch.tensor([1]), torch.tensor([0]), 4, source=other)  # from a joint store
    rec.copy_blocks(torch.tensor([0]), torch.tensor([1]), 4, source=apart)  # into one
    for mine, theirs, was, of in zip(rec.fields(), apart.fields(), spec.fields(), other.fields(), strict=True):
        assert torch.equal(theirs[:4], of[4:8]) and torch.equal(theirs[4:], was[4:])
        assert torch.equal(mine[4:8], of[4:8]) and torch.equal(mine[:4], was[:4]) and torch.equal(mine[8:], was[8:])


def test_digests_turned_on_after_a_move_move_too() -> None:
    rec = filled(9, 0, digests=False)
    rec.copy_blocks(torch.tensor([0]), torch.tensor([1]), 4)  # the block views are built without digests
    rec.enable_digests()
    assert rec.digests is not None
    rec.digests[:4] = 7
    rec.copy_blocks(torch.tensor([0]), torch.tensor([1]), 4)
    assert rec.digests.tolist() == [7] * 8 + [0]
    assert torch.equal(rec.links[4:8], rec.links[:4])


def test_a_block_past_the_whole_blocks_is_refused() -> None:
    rec = filled(9, 0, digests=False)  # two whole blocks of 4 and the reserved slot 8
    before = [t.clone() for t in rec.fields()]
    with pytest.raises(IndexError):
        rec.copy_blocks(torch.tensor([0]), torch.tensor([2]), 4)
    assert all(torch.equal(a, b) for a, b in zip(before, rec.fields(), strict=True))  # nothing written


@pytest.mark.parametrize("digests", [False, True])
def test_a_clone_is_laid_out_as_allocated_whatever_the_original_was(digests: bool) -> None:
    rec = filled(9, 3, digests)
    apart = RecordStore(rec.tokens.clone(), rec.positions.clone(), rec.links.clone())
    if digests:
        apart.enable_digests()
        assert apart.digests is not None and rec.digests is not None
        apart.digests.copy_(rec.digests)
    for original in (rec, apart):
        copy = original.clone()
        assert len(copy.blocks(4)) == len(rec.blocks(4)) == 2 + digests  # tokens and positions joint
        for mine, theirs in zip(copy.fields(), original.fields(), strict=True):
            assert torch.equal(mine, theirs) and mine.data_ptr() != theirs.data_ptr()
