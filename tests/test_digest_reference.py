"""The digest reference against the independent scalar statement, and what the digest tells apart.

Every layout and dtype the digest reads (token-major, paged, transposed K, vLLM's CPU cache, unaligned
slices, transformers' shifted layer views; bf16/fp16/fp32/fp8 with scales) gives the scalar oracle's
value; structured edits of one slot's bytes change that slot's digest and no other; copies keep it.
"""

from __future__ import annotations

import random

import pytest
import torch

import digest_cases as dc
import digest_oracle
from digest_cases import planned_step
from kvcanary import digest as D
from kvcanary.ops import digest_reference as dref
from kvcanary.schema import Field, Phase, Reason
from kvcanary.workspace import PlanWorkspace, ViolationLog


def _digests(pool: dc.Pool) -> torch.Tensor:
    return dref.slot_digests(pool.layout, torch.arange(pool.num_slots))


@pytest.mark.parametrize("kind", dc.LAYOUTS)
@pytest.mark.parametrize("dtype", dc.DTYPES, ids=str)
def test_reference_matches_scalar_oracle(kind: str, dtype: torch.dtype) -> None:
    rng = random.Random(dc.LAYOUTS.index(kind) * 10 + dc.DTYPES.index(dtype))
    for _ in range(3):
        pool = dc.random_pool(rng, kind=kind, dtype=dtype)
        got = _digests(pool)
        want = torch.tensor([digest_oracle.slot_digest(pool.layout, s) for s in range(pool.num_slots)])
        assert torch.equal(got, want)
        assert bool((got & 1).all())  # odd: never the "no digest" value


def test_every_single_bit_of_a_slot_changes_its_digest_and_no_other() -> None:
    rng = random.Random(7)
    for dtype in dc.DTYPES:
        pool = dc.random_pool(rng, dtype=dtype, layers=2, with_scales=True)
        before = _digests(pool)
        slot = rng.randrange(pool.num_slots)
        for comp in pool.layout.components:  # every layer, K and V and scales
            for bit in range(8 * comp.shape.element_size):
                head, d = rng.randrange(comp.shape.heads), rng.randrange(comp.shape.dim)
                dc.flip_bit(comp, slot, head, d, bit)
                after = _digests(pool)
                changed = (after != before).nonzero().flatten().tolist()
                assert changed == [slot], (comp.view.dtype, bit)
                dc.flip_bit(comp, slot, head, d, bit)
                assert torch.equal(_digests(pool), before)


def test_structured_edits_change_the_digest() -> None:
    rng = random.Random(11)
    for kind in dc.LAYOUTS:
        pool = dc.random_pool(rng, kind=kind, dtype=torch.bfloat16, layers=2, with_scales=False)
        if pool.num_slots < 3:
            continue
        comp = pool.layout.components[-1]
        before = _digests(pool)
        s = rng.randrange(1, pool.num_slots - 1)
        row = comp.view[s // comp.shape.block_size, s % comp.shape.block_size]
        saved = row.clone()

        def row_of(slot: int, comp: D.KVComponent = comp) -> torch.Tensor:
            return comp.view[slot // comp.shape.block_size, slot % comp.shape.block_size].clone()

        edits = {
            "zeroed row": torch.zeros_like(saved),
            "row of the next slot": row_of(s + 1),
            "row of the previous slot": row_of(s - 1),
            "dims shifted by one": torch.roll(saved, 1, dims=1),
            "heads swapped": saved.flip(0),
        }
        for name, edited in edits.items():
            row.copy_(edited)
            if torch.equal(row.view(torch.int16), saved.view(torch.int16)):
                continue  # the edit kept every byte (one head, equal neighbours)
            after = _digests(pool)
            assert after[s] != before[s], (kind, name)
            row.copy_(saved)
        assert torch.equal(_digests(pool), before)


def test_content_only_and_order_independent() -> None:
    rng = random.Random(3)
    pool = dc.random_pool(rng, kind="paged", dtype=torch.float16, layers=3)
    for comp in pool.layout.components:
        dc.copy_slot_bytes(comp, 0, pool.num_slots - 1)
    d = _digests(pool)
    assert d[0] == d[pool.num_slots - 1]  # the same bytes in another slot: the same digest
    # Partial sums over any split of the components add up to the whole (shards, layer subsets).
    slots = torch.arange(pool.num_slots)
    whole = dref.slot_digests(pool.layout, slots)
    keys = dref.word_keys(pool.layout.words, "cpu")
    parts = torch.zeros_like(slots)
    for comp, base in zip(pool.layout.components, pool.layout.word_bases(), strict=True):
        words = dref._component_words(comp.view, slots)
        parts += torch.ops.aten.sum(dref.hashing.fmix64_t(words ^ keys[base : base + comp.shape.words]), 1)
    assert torch.equal(parts | 1, whole)


def test_component_api_refuses_bad_views() -> None:
    with pytest.raises(ValueError, match="4-D"):
        D.KVComponent(torch.zeros(4, 2, 8))
    with pytest.raises(ValueError, match="element size"):
        D.KVComponent(torch.zeros(2, 1, 1, 1, dtype=torch.complex128))
    with pytest.raises(ValueError, match="non-empty"):
        D.KVComponent(torch.zeros(2, 1, 0, 4))
    with pytest.raises(ValueError, match="at least one"):
        D.DigestLayout(())
    with pytest.raises(ValueError, match="positive"):
        D.DigestWorkspace.allocate(0)


# --------------------------------------------------------------------------- the calls


def test_budgeted_verify_covers_every_read_position_within_its_period() -> None:
    torch.manual_seed(0)
    prefix = [1, 17, 40, 0, 33]
    group, batch, plan_ws = planned_step(160, prefix)
    layout = D.DigestLayout((D.token_major(torch.randn(160, 2, 8)),))
    digests = torch.zeros(160, dtype=torch.int64)
    seen: set[tuple[int, int]] = set()
    period = 3
    ws = D.DigestWorkspace.allocate(4096)
    for _ in range(period):
        first, tiles, start, end = dref.selected_tiles(plan_ws, batch.rows, int(ws.epoch[0]), period, 16)
        for r in range(batch.batch_size):
            for k in range(int(tiles[r])):
                g = int(first[r]) + k * period
                seen |= {(r, p) for p in range(g * 16, g * 16 + 16) if int(start[r]) <= p < int(end[r])}
        dref.verify_planned(group, layout, digests, ws, ViolationLog.allocate(4), batch, plan_ws, period=period)
    assert seen == {(r, p) for r, n in enumerate(prefix) for p in range(n)}
    assert int(ws.epoch[0]) == period


def test_verify_reports_only_changed_slots_with_their_position() -> None:
    torch.manual_seed(1)
    prefix = [20, 5]
    group, batch, plan_ws = planned_step(64, prefix)
    kv = torch.randn(64, 2, 8)
    layout = D.DigestLayout((D.token_major(kv),))
    digests = torch.zeros(64, dtype=torch.int64)
    ws, log = D.DigestWorkspace.allocate(256), ViolationLog.allocate(8)
    dref.stamp_list(group, layout, digests, ws, log, torch.arange(64))
    assert int(digests[0]) == 0 and bool((digests[1:] & 1).all())  # reserved slot 0 is never stamped
    victim = int(batch.table[1, 7])
    kv[victim, 1, 3] = kv[victim, 1, 3] * 2 + 1
    dref.verify_planned(group, layout, digests, ws, log, batch, plan_ws, period=1)
    rows = log.rows()
    assert rows.shape[0] == 1
    row = rows[0]
    assert row[Field.REASONS] == Reason.DIGEST_MISMATCH and row[Field.PHASE] == Phase.DIGEST_VERIFY
    assert (row[Field.SLOT], row[Field.EXPECTED_POSITION], row[Field.BATCH_ROW]) == (victim, 7, 0)
    assert row[Field.EXPECTED_LINK] == digests[victim] and row[Field.STORED_LINK] != digests[victim]
    # A slot this step also writes (a ring reused in the step) is left to the stamp.
    log.clear()
    plan_ws.write_marks[victim] = 2 * (1 + int(plan_ws.epoch[0]) % PlanWorkspace.MARK_PERIOD)
    dref.verify_planned(group, layout, digests, ws, log, batch, plan_ws, period=1)
    assert log.total() == 0
    plan_ws.write_marks[victim] = 0
    # Never-stamped slots are not compared; the list call reports out-of-range indices when asked.
    log.clear()
    digests[victim] = 0
    dref.verify_list(group, layout, digests, ws, log, torch.tensor([victim, 64, -1, -5]), report_range=True)
    rows = log.rows()
    assert rows[:, Field.REASONS].tolist() == [Reason.SLOT_OUT_OF_RANGE] * 2
    assert rows[:, Field.BAD_INDEX].tolist() == [64, -5]


def test_pinned_vectors() -> None:
    """The definition's pinned values (also in docs/design.md §12): a change of constants or packing fails here."""
    assert digest_oracle.splitmix_finalize(D.DIGEST_SEED + D.DIGEST_GAMMA) == 0x5D1EB797172A6573  # key(0)
    zeros = torch.zeros(1, 1, 2, dtype=torch.float32)  # one head row of two fp32 zeros: one word, 0
    one = torch.tensor([[[1.0, 0.0]]])  # word 0x3f800000
    for t, want in ((zeros, 0xC18C5D9838C562DD), (one, 0x5458A63D4B437BDB)):
        layout = D.DigestLayout((D.token_major(t),))
        assert digest_oracle.slot_digest(layout, 0) & digest_oracle.M64 == want
        assert int(dref.slot_digests(layout, torch.tensor([0]))[0]) & digest_oracle.M64 == want
