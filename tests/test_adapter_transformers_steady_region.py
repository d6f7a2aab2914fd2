"""The steady step's staged region: what it sends equals what the full path's pack sends for the same values, byte
for byte, for any batch of the class (rows joining or leaving, new query lengths); it refuses, sending nothing, when
the staging moved, the truth's writes do not fit or the batch outgrows the class."""

from __future__ import annotations

import array
import random

import numpy as np
import pytest
import torch

from kvcanary.adapters.transformers_cb.staging import Pack, Staging
from kvcanary.adapters.transformers_cb.steady_region import StagedRegion
from kvcanary.adapters.transformers_cb.step_buffers import pack_common
from kvcanary.adapters.transformers_cb.step_plan import RowPlan
from kvcanary.adapters.transformers_cb.truth_store import TruthUpdate


def _truth(rng: random.Random, b: int, writes: int) -> TruthUpdate:
    return TruthUpdate(
        gather=array.array("q", [0] + [rng.randrange(1, 40) for _ in range(b)]),
        lens=array.array("q", [rng.randrange(1, 500) for _ in range(b)]),
        width=500,
        cells=array.array("q", [rng.randrange(0, 1 << 20) for _ in range(writes)]),
        tokens=array.array("i", [rng.randrange(-(1 << 31), 1 << 31) for _ in range(writes)]),
    )


def _rows(past: tuple[int, ...], query: tuple[int, ...] | None = None) -> RowPlan:
    return RowPlan(past, query or (1,) * len(past), (True,) * len(past))


def _lengths(rows: RowPlan) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return rows.past_lens, rows.query_lens


def _full_send(
    staging: Staging, rows: RowPlan, truth: TruthUpdate, sizes: array.array[int], n_rows: int, masks: tuple = ()
):
    """The full path's layout (step_buffers.pack_common, then the meta, the windows' trash masks and the truth's
    writes), sent."""
    pack = Pack()
    common = pack_common(pack, rows, truth.padded(n_rows), sizes, n_rows)
    meta = array.array("q", [len(truth.cells), 0, 0])
    common["truth_meta"] = pack.add(meta)
    for m in masks:
        pack.add(m)
    cells, tokens = pack.add(truth.cells), pack.add(truth.tokens)
    meta[1], meta[2] = pack.offsets[cells] // 8, pack.offsets[tokens] // 4
    staging.send(pack)
    return pack, common, pack.offsets[tokens] + 4 * len(truth.tokens)  # the bytes that mean something


@pytest.mark.parametrize(("b", "n_rows", "groups"), [(1, 1, 1), (3, 16, 2), (7, 7, 1), (13, 16, 3)])
def test_the_region_sends_what_the_full_path_packs(b: int, n_rows: int, groups: int) -> None:
    rng = random.Random(b * 100 + n_rows)
    past = tuple(rng.randrange(0, 400) for _ in range(b))
    sizes = array.array("q", [rng.randrange(1, 1000) for _ in range(3 * groups)])
    full, steady = Staging(torch.device("cpu")), Staging(torch.device("cpu"))
    pack, common, _ = _full_send(steady, _rows(past), _truth(rng, b, 5), sizes, n_rows)
    region = StagedRegion(pack, common, steady.generation)
    # The same rows a token further, then batches of the class with rows gone or new and other query lengths.
    batches = [b, b, max(1, b - 2), n_rows, 1, b] if n_rows > 1 else [1, 1, 1]
    for k, writes in zip(batches, (0, 1, 37, 5, 2, 9), strict=False):
        past = tuple(rng.randrange(0, 400) for _ in range(k)) if k != len(past) else tuple(p + 1 for p in past)
        rows = _rows(past, tuple(rng.randrange(1, 9) for _ in range(k)))
        truth = _truth(rng, k, writes)
        sizes = array.array("q", [rng.randrange(1, 1000) for _ in range(3 * groups)])
        laid_out, *_ = _full_send(full, rows, truth, sizes, n_rows)
        assert region.send(steady, _lengths(rows), truth, sizes)
        want, got = full.whole(torch.int32), steady.whole(torch.int32)
        for off, m in zip(laid_out.offsets, laid_out.mems, strict=True):  # every array (the gaps between: padding)
            at = slice(off // 4, (off + m.nbytes) // 4)
            assert torch.equal(want[at], got[at])


@pytest.mark.parametrize("first", [1, 4, 5, 6, 8])
def test_the_first_steady_step_may_have_fewer_or_more_rows_than_the_full_step(first: int) -> None:
    """The region starts from the full step's rows (5 of a class of 8): a first step of any size sends what the full
    path would."""
    rng = random.Random(first)
    sizes = array.array("q", [7, 70, 7])
    full, steady = Staging(torch.device("cpu")), Staging(torch.device("cpu"))
    pack, common, _ = _full_send(steady, _rows(tuple(range(10, 15))), _truth(rng, 5, 2), sizes, 8)
    region = StagedRegion(pack, common, steady.generation)
    rows, truth = _rows(tuple(range(20, 20 + first))), _truth(rng, first, 3)
    laid_out, *_ = _full_send(full, rows, truth, sizes, 8)
    assert region.send(steady, _lengths(rows), truth, sizes)
    want, got = full.whole(torch.int32), steady.whole(torch.int32)
    for off, m in zip(laid_out.offsets, laid_out.mems, strict=True):
        at = slice(off // 4, (off + m.nbytes) // 4)
        assert torch.equal(want[at], got[at])


def test_the_region_refuses_when_the_staging_moved_or_the_batch_or_the_writes_do_not_fit() -> None:
    rng = random.Random(5)
    staging = Staging(torch.device("cpu"))
    sizes = array.array("q", [3, 30, 2])
    pack, common, _ = _full_send(staging, _rows((10, 20)), _truth(rng, 2, 3), sizes, 2)
    region = StagedRegion(pack, common, staging.generation)
    before = staging.whole(torch.int32).clone()
    too_many = staging.capacity // 8
    assert not region.send(staging, _lengths(_rows((11, 21))), _truth(rng, 2, too_many), sizes)
    assert not region.send(staging, _lengths(_rows((11, 21, 5))), _truth(rng, 3, 1), sizes)  # more rows than the class
    assert torch.equal(staging.whole(torch.int32), before)  # nothing sent
    assert region.send(staging, _lengths(_rows((11, 21))), _truth(rng, 2, 4), sizes)
    staging.send(Pack([array.array("q", range(staging.capacity // 4))]))  # outgrows it: a new device buffer
    assert not region.send(staging, _lengths(_rows((12, 22))), _truth(rng, 2, 4), sizes)


def test_a_pack_not_laid_out_as_the_full_path_is_refused() -> None:
    rng = random.Random(6)
    sizes = array.array("q", [1, 2, 3])
    pack, common, _ = _full_send(Staging(torch.device("cpu")), _rows((1, 2)), _truth(rng, 2, 1), sizes, 2)
    swapped = dict(common, rows=common["prefix"], prefix=common["rows"])
    with pytest.raises(ValueError, match="must lead the pack"):
        StagedRegion(pack, swapped, 0)
    narrow = Pack([array.array("i", [1]), *pack.mems[1:]])
    with pytest.raises(ValueError, match="int64"):
        StagedRegion(narrow, common, 0)


def _mask(bits: list[bool], length: int) -> memoryview:
    return memoryview(bytearray(np.array(bits, dtype=np.bool_).tobytes()) + bytearray(length - len(bits))).cast("?")


def test_the_windows_trash_masks_are_sent_as_the_full_path_packs_them() -> None:
    """Each sliding group's mask, padded to the class's tokens: set where a step has one, zero where it has none (None:
    cleared where the last step's mask, or the full step's, had one)."""
    rng = random.Random(7)
    full, steady = Staging(torch.device("cpu")), Staging(torch.device("cpu"))
    sizes, tokens = array.array("q", [4, 9, 4, 4, 9, 4]), 16
    masks = (_mask([True, False], tokens), _mask([], tokens))
    pack, common, _ = _full_send(steady, _rows((3, 5)), _truth(rng, 2, 2), sizes, 4, masks)
    region = StagedRegion(pack, common, steady.generation, [7, 8])
    for bits in ([None, [True, True, False, True]], [[False] * 3 + [True], None], [None, None]):
        step = tuple(_mask(b or [], tokens) for b in bits)  # as step_plan.trash_bytes builds them
        laid_out, *_ = _full_send(full, _rows((3, 5)), truth := _truth(rng, 2, 3), sizes, 4, step)
        masks_or_none = tuple(None if b is None else m for b, m in zip(bits, step, strict=True))  # trash_mask's
        assert region.send(steady, _lengths(_rows((3, 5))), truth, sizes, masks_or_none)
        want, got = full.whole(torch.int32), steady.whole(torch.int32)  # every array's bytes (16 a mask)
        for off, m in zip(laid_out.offsets, laid_out.mems, strict=True):
            at = slice(off // 4, (off + m.nbytes) // 4)
            assert torch.equal(want[at], got[at])
    too_long = [_mask([True] * (tokens + 1), tokens + 1), _mask([], tokens)]
    assert not region.send(steady, _lengths(_rows((3, 5))), _truth(rng, 2, 1), sizes, too_long)
