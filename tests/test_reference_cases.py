"""Hand-written cases for the reference plan -> verify -> stamp, with exact records and log rows.

Expected links are computed here with the scalar spec (:func:`kvcanary.hashing.link_step`); every
violation row is compared field by field.  The conventions of the row fields are those of
:class:`kvcanary.schema.Field`: plan rows have no slot (-1) and carry prefix / prefix+extend as
positions; stamp rows have no predecessor (-1) and no expected link (0).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvcanary import CanaryGroup, GroupCanary, GroupKind, ViolationLog
from kvcanary.hashing import LINK_ANCHOR
from kvcanary.schema import NUM_REASONS, Counter, Field, Phase, Reason
from reference_helpers import (
    A_LINKS,
    A_SEQ,
    A_SLOTS,
    ANCHOR,
    B_LINKS,
    B_SEQ,
    B_SLOTS,
    FULL,
    canary_for,
    chain,
    decode_both,
    expect,
    link_of,
    make_batch,
    reason_counts,
    records_at,
    row,
    run_step,
    two_requests,
    two_table,
    verify_row,
)

# --------------------------------------------------------------------------- clean workloads


def test_one_request_prefill_then_decode() -> None:
    canary = canary_for(FULL)
    log = canary.new_log()
    table = two_table()
    canary.plan(make_batch(table, [1], [0], [4], A_SEQ[:4], [0, 1, 2, 3], A_SLOTS[:4]), log)
    ws = canary.workspace
    assert ws.verify_offsets[:2].tolist() == [0, 0]
    assert ws.write_offsets[:2].tolist() == [0, 4]
    assert ws.seed_links[:1].tolist() == [ANCHOR]
    assert ws.row_state[:1].tolist() == [ws.ROW_ACTIVE]
    batch = make_batch(table, [1], [0], [4], A_SEQ[:4], [0, 1, 2, 3], A_SLOTS[:4])
    canary.verify(batch, log)
    canary.stamp(batch, log)
    assert records_at(canary, A_SLOTS[:4]) == list(zip(A_SEQ[:4], range(4), A_LINKS[:4], strict=True))

    decode = make_batch(table, [1], [4], [1], [A_SEQ[4]], [4], [A_SLOTS[4]])
    canary.plan(decode, log)
    assert ws.verify_offsets[:2].tolist() == [0, 4]
    assert ws.window_starts[:1].tolist() == [0]
    assert ws.seed_links[:1].tolist() == [A_LINKS[3]]  # chains on from the stored record of position 3
    canary.verify(decode, log)
    canary.stamp(decode, log)
    assert records_at(canary, [A_SLOTS[4]]) == [(A_SEQ[4], 4, A_LINKS[4])]
    c = log.counters
    assert (log.total(), int(c[Counter.VERIFIED]), int(c[Counter.STAMPED]), int(c[Counter.CALLS])) == (0, 4, 5, 6)
    assert int(c[Counter.SKIPPED]) == 0 and int(c[:NUM_REASONS].sum()) == 0
    # Untouched slots stay empty.
    others = [s for s in range(FULL.num_slots) if s not in A_SLOTS[:5]]
    assert canary.records.links[others].eq(0).all()


def test_chunked_prefill_across_steps_with_a_block_table() -> None:
    group = CanaryGroup(num_slots=64, page_size=4, reserved_slots=(0,), padding_row=0)
    canary = canary_for(group)
    log = canary.new_log()
    table = torch.zeros(2, 4, dtype=torch.int32)
    table[1] = torch.tensor([7, 2, 12, 5])  # blocks; slot = block * 4 + pos % 4
    seq = [1000 + 7 * i for i in range(9)]
    slots = [int(table[1, p // 4]) * 4 + p % 4 for p in range(9)]
    verified = []
    for start, n in [(0, 3), (3, 4), (7, 2)]:
        pos = list(range(start, start + n))
        batch = make_batch(table, [1], [start], [n], seq[start : start + n], pos, slots[start : start + n])
        canary.plan(batch, log)
        seed = canary.workspace.seed_links[0].item()
        assert seed == (ANCHOR if start == 0 else chain(seq)[start - 1])
        before = int(log.counters[Counter.VERIFIED])
        canary.verify(batch, log)
        canary.stamp(batch, log)
        verified.append(int(log.counters[Counter.VERIFIED]) - before)
    assert verified == [0, 3, 7]
    # Chunk boundaries leave no trace: the records are those of one 9-token prefill.
    assert records_at(canary, slots) == list(zip(seq, range(9), chain(seq), strict=True))
    assert log.total() == 0


def test_mixed_batch_of_prefill_decode_and_chunk() -> None:
    canary, log, table = two_requests()
    table[0, :3] = torch.tensor([30, 31, 32])  # padding row 0 is never read, whatever it holds
    c_slots = [33, 34, 35]
    table = torch.cat([table, torch.tensor([c_slots + [0] * 5], dtype=torch.int32)])  # row 3: request C
    c_seq = [51, 52, 53]
    # A decodes, C prefills three tokens, B extends by one (a chunk of one after three).
    batch = make_batch(
        table,
        [1, 3, 2],
        [4, 0, 3],
        [1, 3, 1],
        [A_SEQ[4], *c_seq, B_SEQ[3]],
        [4, 0, 1, 2, 3],
        [A_SLOTS[4], *c_slots, B_SLOTS[3]],
    )
    canary.plan(batch, log)
    ws = canary.workspace
    assert ws.verify_offsets[:4].tolist() == [0, 4, 4, 7]
    assert ws.write_offsets[:4].tolist() == [0, 1, 4, 5]
    assert ws.seed_links[:3].tolist() == [A_LINKS[3], ANCHOR, B_LINKS[2]]
    canary.verify(batch, log)
    canary.stamp(batch, log)
    assert log.total() == 0
    assert records_at(canary, c_slots) == list(zip(c_seq, range(3), chain(c_seq), strict=True))
    assert records_at(canary, [A_SLOTS[4], B_SLOTS[3]]) == [(15, 4, A_LINKS[4]), (34, 3, B_LINKS[3])]


def test_padding_rows_contribute_nothing() -> None:
    canary, log, table = two_requests()
    # Padding rows before and between the live rows; one carries two junk tokens aimed at live slots.
    batch = make_batch(
        table,
        [0, 1, 0, 2],
        [0, 4, 3, 3],
        [0, 1, 2, 1],
        [A_SEQ[4], 99, 98, B_SEQ[3]],
        [4, 0, 0, 3],
        [A_SLOTS[4], A_SLOTS[0], B_SLOTS[0], B_SLOTS[3]],
    )
    canary.plan(batch, log)
    ws = canary.workspace
    assert ws.row_state[:4].tolist() == [ws.ROW_PADDING, ws.ROW_ACTIVE, ws.ROW_PADDING, ws.ROW_ACTIVE]
    assert ws.verify_offsets[:5].tolist() == [0, 0, 4, 4, 7]
    assert ws.write_offsets[:5].tolist() == [0, 0, 1, 3, 4]  # the padding row's tokens keep their place
    canary.verify(batch, log)
    canary.stamp(batch, log)
    assert log.total() == 0
    assert int(log.counters[Counter.STAMPED]) == 7 + 2
    assert records_at(canary, [A_SLOTS[0], B_SLOTS[0]]) == [(11, 0, A_LINKS[0]), (31, 0, B_LINKS[0])]


def test_without_a_padding_row_row_zero_is_a_request() -> None:
    group = CanaryGroup(num_slots=40, reserved_slots=(), padding_row=None)
    canary = canary_for(group)
    log = canary.new_log()
    table = two_table()
    table[0, :2] = torch.tensor([30, 31])
    rows = run_step(canary, log, make_batch(table, [0], [0], [2], [7, 8], [0, 1], [30, 31]))
    assert rows == [] and records_at(canary, [30, 31]) == list(zip([7, 8], [0, 1], chain([7, 8]), strict=True))
    assert int(log.counters[Counter.STAMPED]) == 2


def test_clean_multi_step_run_is_silent() -> None:
    canary, log, table = two_requests()
    for step in range(4):  # A decodes 4 and 5; B decodes 3..6
        a_pos, b_pos = 4 + min(step, 1), 3 + step
        a_on = step < 2
        a_seq = [*A_SEQ, 16]
        b_seq = [*B_SEQ, 35, 36, 37]
        rows, pre, ext, ids, pos, loc = [], [], [], [], [], []
        if a_on:
            rows += [1]
            pre += [a_pos]
            ext += [1]
            ids += [a_seq[a_pos]]
            pos += [a_pos]
            loc += [A_SLOTS[a_pos]]
        rows += [2]
        pre += [b_pos]
        ext += [1]
        ids += [b_seq[b_pos]]
        pos += [b_pos]
        loc += [B_SLOTS[b_pos]]
        assert run_step(canary, log, make_batch(table, rows, pre, ext, ids, pos, loc)) == []
    assert int(log.counters[Counter.VERIFIED]) == (4 + 5) + (3 + 4 + 5 + 6)
    assert log.total() == 0 and int(log.counters[:NUM_REASONS].sum()) == 0


# --------------------------------------------------------------------------- reserved slots, not stored


def test_reserved_slots() -> None:
    canary, log, table = two_requests()
    table[2, 2] = 39  # B's position 2 now points at the reserved sentinel
    rows = run_step(canary, log, decode_both(table, loc=[0, B_SLOTS[3]]))  # and A writes into slot 0
    assert canary.workspace.seed_links[:2].tolist() == [A_LINKS[3], ANCHOR]  # no seed from a reserved slot
    assert rows == [
        row(Phase.VERIFY, Reason.RESERVED_SLOT, 1, 2, 39, 21, 2, 0, -1, 0, 0, 0, -1),
        row(Phase.STAMP, Reason.RESERVED_SLOT, 0, 1, 0, -1, 4, 4, -1, 15, 0, A_LINKS[4], -1),
    ]
    assert records_at(canary, [0, 39]) == [(0, 0, 0), (0, 0, 0)]  # reserved slots are never written
    assert int(log.counters[Counter.STAMPED]) == 7 + 1


def test_reserved_predecessor_and_seed_are_never_trusted() -> None:
    canary, log, table = two_requests()
    recs = canary.records
    recs.tokens[39], recs.positions[39], recs.links[39] = 5, 2, 777  # junk in the sentinel's record
    table[1, 1] = 39  # A's position 1: its successor's predecessor is now the sentinel
    table[2, 2] = 39  # B's position 2: the cell B's chain seed is read from
    rows = run_step(canary, log, decode_both(table))
    sentinel = {"STORED_POSITION": 2, "STORED_TOKEN": 5, "EXPECTED_LINK": 0, "STORED_LINK": 777}
    assert rows == [
        # A's position 2 is not in the log: a reserved predecessor leaves its link unchecked.
        verify_row(Reason.RESERVED_SLOT, 0, 1, 39, A_SLOTS[0], **sentinel),
        verify_row(Reason.RESERVED_SLOT, 1, 2, 39, B_SLOTS[1], **sentinel),
    ]
    assert canary.workspace.seed_links[:2].tolist() == [A_LINKS[3], ANCHOR]
    assert records_at(canary, [B_SLOTS[3]]) == [(34, 3, link_of(LINK_ANCHOR, 34, 3))]


def test_not_stored_token_advances_the_chain_without_a_write() -> None:
    canary, log, table = two_requests()
    # A writes positions 4 and 5; position 4's KV is not kept (out_cache_loc -1).
    batch = make_batch(table, [1], [4], [2], [15, 16], [4, 5], [-1, A_SLOTS[5]])
    assert run_step(canary, log, batch) == []
    assert records_at(canary, [A_SLOTS[4], A_SLOTS[5]]) == [(0, 0, 0), (16, 5, chain([*A_SEQ, 16])[5])]
    assert int(log.counters[Counter.STAMPED]) == 7 + 1


# --------------------------------------------------------------------------- sliding window, draft, truth


def ring_group() -> tuple[CanaryGroup, torch.Tensor, torch.Tensor]:
    """Window 3 over a ring of 4 pool slots (1..4) reached through a lookup; slot 0 is reserved."""
    group = CanaryGroup(
        num_slots=5,
        group_id=3,
        name="swa",
        kind=GroupKind.SLIDING_WINDOW,
        window=3,
        uses_lookup=True,
        reserved_slots=(0,),
        padding_row=0,
    )
    table = torch.zeros(2, 16, dtype=torch.int32)
    table[1] = torch.arange(100, 116)  # full-pool indices
    lookup = torch.zeros(120, dtype=torch.int64)
    lookup[100:116] = 1 + torch.arange(16) % 4  # position p lives in ring slot 1 + p % 4: recycled
    return group, table, lookup


RING_SEQ = [200 + 3 * i for i in range(14)]


def ring_slot(p: int) -> int:
    return 1 + p % 4


def test_sliding_window_ring_is_silent_and_verifies_only_the_window() -> None:
    group, table, lookup = ring_group()
    canary = canary_for(group)
    log = canary.new_log()
    steps = [(0, 2), (2, 3)] + [(p, 1) for p in range(5, 12)]  # prefill, a chunk, then decodes
    verified = []
    for pre, n in steps:
        pos = list(range(pre, pre + n))
        batch = make_batch(table, [1], [pre], [n], RING_SEQ[pre : pre + n], pos, [100 + p for p in pos], lookup=lookup)
        before = int(log.counters[Counter.VERIFIED])
        assert run_step(canary, log, batch) == []
        assert canary.workspace.window_starts[0].item() == max(pre - 3, 0)
        verified.append(int(log.counters[Counter.VERIFIED]) - before)
    assert verified == [0, 2] + [3] * 7
    links = chain(RING_SEQ[:12])
    # Each ring slot holds the newest of the positions mapped to it: 8..11.
    assert records_at(canary, [ring_slot(p) for p in range(8, 12)]) == [
        (RING_SEQ[p], p, links[p]) for p in range(8, 12)
    ]


def test_sliding_window_wrong_lookup_entry_is_caught() -> None:
    group, table, lookup = ring_group()
    canary = canary_for(group)
    log = canary.new_log()
    for pre, n in [(0, 4), (4, 1), (5, 1), (6, 1), (7, 1), (8, 1), (9, 1)]:
        pos = list(range(pre, pre + n))
        batch = make_batch(table, [1], [pre], [n], RING_SEQ[pre : pre + n], pos, [100 + p for p in pos], lookup=lookup)
        assert run_step(canary, log, batch) == []
    links = chain(RING_SEQ[:11])
    bad = lookup.clone()
    bad[100 + 8] = ring_slot(9)  # position 8 now maps onto position 9's slot: a ring off by one
    batch = make_batch(table, [1], [10], [1], [RING_SEQ[10]], [10], [110], lookup=bad)
    rows = run_step(canary, log, batch)
    assert rows == [
        # Position 8 reads position 9's record: wrong position, and its link does not follow 7.
        expect(
            Phase.VERIFY,
            Reason.POSITION_MISMATCH | Reason.LINK_MISMATCH,
            group=3,
            BATCH_ROW=0,
            TABLE_ROW=1,
            SLOT=ring_slot(9),
            PRED=ring_slot(7),
            EXPECTED_POSITION=8,
            STORED_POSITION=9,
            EXPECTED_TOKEN=-1,
            STORED_TOKEN=RING_SEQ[9],
            EXPECTED_LINK=link_of(links[7], RING_SEQ[9], 9),
            STORED_LINK=links[9],
            BAD_INDEX=-1,
        ),
        # Position 9's predecessor is now its own slot.
        expect(
            Phase.VERIFY,
            Reason.LINK_MISMATCH,
            group=3,
            BATCH_ROW=0,
            TABLE_ROW=1,
            SLOT=ring_slot(9),
            PRED=ring_slot(9),
            EXPECTED_POSITION=9,
            STORED_POSITION=9,
            EXPECTED_TOKEN=-1,
            STORED_TOKEN=RING_SEQ[9],
            EXPECTED_LINK=link_of(links[9], RING_SEQ[9], 9),
            STORED_LINK=links[9],
            BAD_INDEX=-1,
        ),
    ]


def _draft_run(offset: int, truth_len_extra: int) -> tuple[list[dict[str, int]], GroupCanary]:
    """A draft pool: KV position p holds token seq[p + 1].  Prefill 0..3, then decode position 4."""
    group = CanaryGroup(num_slots=16, token_offset=offset, reserved_slots=(0,), padding_row=0)
    canary = canary_for(group)
    log = canary.new_log()
    seq = [70, 71, 72, 73, 74, 75, 76]
    table = torch.zeros(2, 8, dtype=torch.int32)
    table[1] = torch.arange(1, 9)
    truth = torch.zeros(2, 8, dtype=torch.int64)
    truth[1, :7] = torch.tensor(seq)
    rows = []
    for pre, n in [(0, 4), (4, 1)]:
        pos = list(range(pre, pre + n))
        ids = [seq[p + 1] for p in pos]  # what a draft model feeds at position p
        known = pre + n + 1 + truth_len_extra  # the scheduler knows seq[: known]
        batch = make_batch(table, [1], [pre], [n], ids, pos, [1 + p for p in pos], truth=truth, truth_lens=[known])
        rows += run_step(canary, log, batch)
    return rows, canary


def test_draft_offset_reads_truth_one_position_ahead() -> None:
    rows, canary = _draft_run(offset=1, truth_len_extra=0)
    assert rows == []
    seq = [71, 72, 73, 74, 75]
    assert records_at(canary, [1, 2, 3, 4, 5]) == list(zip(seq, range(5), chain(seq), strict=True))


def test_draft_tokens_in_a_target_group_are_caught() -> None:
    rows, _ = _draft_run(offset=0, truth_len_extra=0)
    # Every stamp (4 + 1) writes seq[p + 1] where the target's truth says seq[p]; verify then sees it too.
    stamps = [r for r in rows if r["PHASE"] == Phase.STAMP]
    verifies = [r for r in rows if r["PHASE"] == Phase.VERIFY]
    assert [(r["EXPECTED_POSITION"], r["EXPECTED_TOKEN"], r["STORED_TOKEN"]) for r in stamps] == [
        (p, 70 + p, 71 + p) for p in range(5)
    ]
    assert {r["REASONS"] for r in stamps} == {Reason.WRITE_TOKEN_MISMATCH}
    assert [(r["SLOT"], r["EXPECTED_TOKEN"], r["STORED_TOKEN"]) for r in verifies] == [
        (1 + p, 70 + p, 71 + p) for p in range(4)
    ]
    assert {r["REASONS"] for r in verifies} == {Reason.TOKEN_MISMATCH}


def test_truth_valid_length_bounds_the_token_check() -> None:
    # With a draft offset, position p needs seq[p + 1]: at truth_lens = p + 1 it is unknown, not checked.
    group = CanaryGroup(num_slots=16, token_offset=1, reserved_slots=(0,), padding_row=0)
    table = torch.zeros(2, 8, dtype=torch.int32)
    table[1] = torch.arange(1, 9)
    truth = torch.zeros(2, 8, dtype=torch.int64)
    truth[1, :3] = torch.tensor([70, 71, 72])
    found = {}
    for known in (2, 3):
        canary = canary_for(group)
        log = canary.new_log()
        # Position 1 should hold 72; 99 is wrong.  Position 0 (needs seq[1] = 71) is always known.
        found[known] = run_step(
            canary, log, make_batch(table, [1], [0], [2], [71, 99], [0, 1], [1, 2], truth=truth, truth_lens=[known])
        )
    assert found[2] == []
    assert found[3] == [
        row(Phase.STAMP, Reason.WRITE_TOKEN_MISMATCH, 0, 1, 2, -1, 1, 1, 72, 99, 0, chain([71, 99])[1], -1)
    ]


def test_ground_truth_checks_on_and_off() -> None:
    # The cache holds a self-consistent chain for B, but the scheduler believes position 1 is 99.
    truth = torch.zeros(3, 8, dtype=torch.int64)
    truth[1, :5] = torch.tensor(A_SEQ)
    truth[2, :4] = torch.tensor(B_SEQ)
    truth[2, 1] = 99
    canary, log, table = two_requests()
    assert run_step(canary, log, decode_both(table)) == []  # off: the chain alone cannot know
    canary, log, table = two_requests()
    rows = run_step(canary, log, decode_both(table, truth=truth, truth_lens=[5, 4]))
    assert rows == [row(Phase.VERIFY, Reason.TOKEN_MISMATCH, 1, 2, 21, 20, 1, 1, 99, 32, B_LINKS[1], B_LINKS[1], -1)]


# --------------------------------------------------------------------------- overflow


def test_plan_overflow_verifies_partially_and_counts_the_rest() -> None:
    found = {}
    for cap in (5, 7):
        canary, log, table = two_requests(verify_entries=cap)
        canary.records.links[B_SLOTS[0]] = 12345  # B's position 0: entry 4 of 7
        calls = int(log.counters[Counter.CALLS])
        found[cap] = (run_step(canary, log, decode_both(table)), log.counters.clone())
        assert int(log.counters[Counter.CALLS]) == calls + 3
    rows5, c5 = found[5]
    rows7, c7 = found[7]
    assert (int(c5[Counter.VERIFIED]), int(c5[Counter.SKIPPED])) == (5, 2)
    assert (int(c7[Counter.VERIFIED]), int(c7[Counter.SKIPPED])) == (7, 0)
    # Entries 0..4 checked: the corrupt record is caught; its successor (entry 5) was skipped.
    assert [(r["SLOT"], r["EXPECTED_POSITION"]) for r in rows5] == [(20, 0)]
    assert rows5[0] == row(Phase.VERIFY, Reason.LINK_MISMATCH, 1, 2, 20, -1, 0, 0, -1, 31, B_LINKS[0], 12345, -1)
    assert [(r["SLOT"], r["EXPECTED_POSITION"]) for r in rows7] == [(20, 0), (21, 1)]
    # Stamping is not limited by the verify capacity.
    assert int(c5[Counter.STAMPED]) == int(c7[Counter.STAMPED]) == 9


# --------------------------------------------------------------------------- every reason


def _set(field: str, slot: int, value: int) -> Callable[[GroupCanary, torch.Tensor], None]:
    """A record field of one slot overwritten behind the canary's back."""
    return lambda canary, _table: getattr(canary.records, field).__setitem__(slot, value)


def _point(row: int, pos: int, slot: int) -> Callable[[GroupCanary, torch.Tensor], None]:
    """A table entry pointed at another slot (the engine's mapping corrupted)."""
    return lambda _canary, table: table[row].__setitem__(pos, slot)


_POS_LINK = Reason.POSITION_MISMATCH | Reason.LINK_MISMATCH

# One corruption of the two clean requests each, and every row the next decode of both must log (as
# verify_row arguments: reasons, batch row, position, slot, predecessor, then the stored / expected values).
RECORD_CASES = {
    "a corrupt link flags the record and its successor": (
        _set("links", A_SLOTS[2], 12345),
        [
            (Reason.LINK_MISMATCH, 0, 2, A_SLOTS[2], A_SLOTS[1], 2, 13, A_LINKS[2], 12345),
            (Reason.LINK_MISMATCH, 0, 3, A_SLOTS[3], A_SLOTS[2], 3, 14, link_of(12345, 14, 3), A_LINKS[3]),
        ],
    ),
    "an overwritten last token breaks its own link": (
        _set("tokens", A_SLOTS[3], 77),
        [(Reason.LINK_MISMATCH, 0, 3, A_SLOTS[3], A_SLOTS[2], 3, 77, link_of(A_LINKS[2], 77, 3), A_LINKS[3])],
    ),
    "a wrong position breaks the link too": (
        _set("positions", A_SLOTS[1], 7),
        [
            (_POS_LINK, 0, 1, A_SLOTS[1], A_SLOTS[0], 7, 12, link_of(A_LINKS[0], 12, 7), A_LINKS[1]),
        ],
    ),
    "a never-written slot in a prefix, then its successor chained from link 0": (
        _point(2, 1, 30),
        [
            (Reason.NEVER_WRITTEN, 1, 1, 30, B_SLOTS[0], 0, 0, 0, 0),
            (Reason.LINK_MISMATCH, 1, 2, B_SLOTS[2], 30, 2, 33, link_of(0, 33, 2), B_LINKS[2]),
        ],
    ),
}


@pytest.mark.parametrize("case", list(RECORD_CASES))
def test_a_corrupt_record_or_mapping_is_logged_field_by_field(case: str) -> None:
    corrupt, expected = RECORD_CASES[case]
    canary, log, table = two_requests()
    corrupt(canary, table)
    rows = run_step(canary, log, decode_both(table))
    assert rows == [
        verify_row(reasons, batch_row, pos, slot, pred, STORED_POSITION=stored_pos, STORED_TOKEN=stored_tok,
                   EXPECTED_LINK=expected_link, STORED_LINK=stored_link)
        for reasons, batch_row, pos, slot, pred, stored_pos, stored_tok, expected_link, stored_link in expected
    ]  # fmt: skip
    counts: dict[str, int] = {}
    for reasons, *_ in expected:
        for r in Reason:
            if r & reasons:
                counts[r.name or ""] = counts.get(r.name or "", 0) + 1
    assert reason_counts(log) == counts


def test_slot_and_predecessor_out_of_range_in_verify() -> None:
    canary, log, table = two_requests()
    table[1, 1] = 1000
    rows = run_step(canary, log, decode_both(table))
    assert rows == [
        verify_row(
            Reason.SLOT_OUT_OF_RANGE,
            0,
            1,
            1000,
            A_SLOTS[0],
            STORED_POSITION=0,
            STORED_TOKEN=0,
            EXPECTED_LINK=0,
            STORED_LINK=0,
            BAD_INDEX=1000,
        ),
        verify_row(
            Reason.PREDECESSOR_OUT_OF_RANGE,
            0,
            2,
            A_SLOTS[2],
            1000,
            STORED_POSITION=2,
            STORED_TOKEN=13,
            EXPECTED_LINK=0,
            STORED_LINK=A_LINKS[2],
            BAD_INDEX=1000,
        ),
    ]


def test_negative_table_entry_in_a_block_table() -> None:
    group = CanaryGroup(num_slots=32, page_size=4, reserved_slots=(0,), padding_row=0)
    canary = canary_for(group)
    log = canary.new_log()
    table = torch.zeros(2, 4, dtype=torch.int32)
    table[1, :2] = torch.tensor([3, 5])
    seq = [9, 8, 7, 6, 5]
    slots = [12, 13, 14, 15, 20]
    assert run_step(canary, log, make_batch(table, [1], [0], [5], seq, list(range(5)), slots)) == []
    table[1, 1] = -2  # position 4's block: slot -2 * 4 + 0 = -8
    rows = run_step(canary, log, make_batch(table, [1], [5], [1], [4], [5], [21]), check_values=False)
    assert rows == [
        row(Phase.PLAN, Reason.SEED_OUT_OF_RANGE, 0, 1, -1, -1, 5, 6, -1, 0, 0, 0, -8),
        verify_row(
            Reason.SLOT_OUT_OF_RANGE,
            0,
            4,
            -8,
            15,
            STORED_POSITION=0,
            STORED_TOKEN=0,
            EXPECTED_LINK=0,
            STORED_LINK=0,
            BAD_INDEX=-8,
        ),
        # The new token's own table entry (position 5, block -2) does not lead to the slot it writes.
        row(Phase.STAMP, Reason.NEW_READ_MISMATCH, 0, 1, 21, -1, 5, 5, -1, 4, 0, chain([4], [5])[0], -7),
    ]
    # The seed was not trusted: position 5 chains from the anchor.
    assert records_at(canary, [21]) == [(4, 5, chain([4], [5])[0])]


def test_slot_out_of_range_in_stamp() -> None:
    canary, log, table = two_requests()
    rows = run_step(canary, log, decode_both(table, loc=[40, -5]))
    stamp_kw = {"EXPECTED_TOKEN": -1}
    assert rows == [
        expect(
            Phase.STAMP,
            Reason.SLOT_OUT_OF_RANGE,
            BATCH_ROW=0,
            TABLE_ROW=1,
            SLOT=40,
            EXPECTED_POSITION=4,
            STORED_POSITION=4,
            STORED_TOKEN=15,
            STORED_LINK=A_LINKS[4],
            BAD_INDEX=40,
            **stamp_kw,
        ),
        expect(
            Phase.STAMP,
            Reason.SLOT_OUT_OF_RANGE,
            BATCH_ROW=1,
            TABLE_ROW=2,
            SLOT=-5,
            EXPECTED_POSITION=3,
            STORED_POSITION=3,
            STORED_TOKEN=34,
            STORED_LINK=B_LINKS[3],
            BAD_INDEX=-5,
            **stamp_kw,
        ),
    ]
    assert int(log.counters[Counter.STAMPED]) == 7


def lookup_world() -> tuple[GroupCanary, ViolationLog, torch.Tensor, torch.Tensor, list[int]]:
    """A lookup group (window 3) with one request that prefilled positions 0..4 (full indices 10..14)."""
    group = CanaryGroup(
        num_slots=16,
        group_id=1,
        name="swa",
        kind=GroupKind.SLIDING_WINDOW,
        window=3,
        uses_lookup=True,
        reserved_slots=(0,),
        padding_row=0,
    )
    canary = canary_for(group)
    log = canary.new_log()
    table = torch.zeros(2, 8, dtype=torch.int32)
    table[1] = torch.arange(10, 18)
    lookup = torch.zeros(32, dtype=torch.int32)
    lookup[10:18] = torch.tensor([1 + (3 * p) % 15 for p in range(8)])
    seq = [40, 41, 42, 43, 44, 45]
    batch = make_batch(table, [1], [0], [5], seq[:5], list(range(5)), list(range(10, 15)), lookup=lookup)
    assert run_step(canary, log, batch) == []
    return canary, log, table, lookup, seq


def pool(lookup: torch.Tensor, full: int) -> int:
    return int(lookup[full])


def test_lookup_out_of_range_in_verify_plan_and_stamp() -> None:
    canary, log, table, lookup, seq = lookup_world()
    links = chain(seq)
    table[1, 3] = 40  # position 3's full index is past the 32-entry lookup
    batch = make_batch(table, [1], [5], [1], [seq[5]], [5], [50], lookup=lookup)
    rows = run_step(canary, log, batch, check_values=False)
    common = {"BATCH_ROW": 0, "TABLE_ROW": 1, "EXPECTED_TOKEN": -1}
    assert rows == [
        expect(
            Phase.VERIFY,
            Reason.LOOKUP_OUT_OF_RANGE,
            group=1,
            SLOT=-1,
            PRED=pool(lookup, 12),
            EXPECTED_POSITION=3,
            STORED_POSITION=0,
            STORED_TOKEN=0,
            EXPECTED_LINK=0,
            STORED_LINK=0,
            BAD_INDEX=40,
            **common,
        ),
        # Position 4's predecessor cannot be resolved: its link is not checked.
        expect(
            Phase.VERIFY,
            Reason.LOOKUP_OUT_OF_RANGE,
            group=1,
            SLOT=pool(lookup, 14),
            PRED=-1,
            EXPECTED_POSITION=4,
            STORED_POSITION=4,
            STORED_TOKEN=44,
            EXPECTED_LINK=0,
            STORED_LINK=links[4],
            BAD_INDEX=40,
            **common,
        ),
        # The write into full index 50 cannot be translated either.
        expect(
            Phase.STAMP,
            Reason.LOOKUP_OUT_OF_RANGE,
            group=1,
            SLOT=-1,
            EXPECTED_POSITION=5,
            STORED_POSITION=5,
            STORED_TOKEN=45,
            STORED_LINK=link_of(links[4], 45, 5),
            BAD_INDEX=50,
            **common,
        ),
    ]
    assert reason_counts(log) == {"LOOKUP_OUT_OF_RANGE": 3}


def test_lookup_out_of_range_at_the_seed() -> None:
    canary, log, table, lookup, seq = lookup_world()
    table[1, 4] = -1  # the seed (position 4) cannot be translated
    rows = run_step(canary, log, make_batch(table, [1], [5], [1], [seq[5]], [5], [15], lookup=lookup))
    assert rows[0] == row(Phase.PLAN, Reason.LOOKUP_OUT_OF_RANGE, 0, 1, -1, -1, 5, 6, -1, 0, 0, 0, -1, group=1)
    assert [(r["PHASE"], r["REASONS"], r["EXPECTED_POSITION"], r["BAD_INDEX"]) for r in rows[1:]] == [
        (Phase.VERIFY, Reason.LOOKUP_OUT_OF_RANGE, 4, -1)
    ]
    assert canary.workspace.seed_links[0].item() == ANCHOR


def test_seed_out_of_range_through_the_lookup() -> None:
    canary, log, table, lookup, seq = lookup_world()
    lookup[14] = 99  # position 4 (the seed) translates outside the 16-slot pool
    rows = run_step(canary, log, make_batch(table, [1], [5], [1], [seq[5]], [5], [15], lookup=lookup))
    assert rows == [
        row(Phase.PLAN, Reason.SEED_OUT_OF_RANGE, 0, 1, -1, -1, 5, 6, -1, 0, 0, 0, 99, group=1),
        row(Phase.VERIFY, Reason.SLOT_OUT_OF_RANGE, 0, 1, 99, pool(lookup, 13), 4, 0, -1, 0, 0, 0, 99, group=1),
    ]
    # The untrusted seed falls back to the anchor; the stamp still happens.
    assert records_at(canary, [pool(lookup, 15)]) == [(45, 5, chain([45], [5])[0])]


def test_write_position_mismatch() -> None:
    canary, log, table = two_requests()
    rows = run_step(canary, log, decode_both(table, pos=[5, 3]))  # A's token claims position 5
    assert rows == [
        expect(
            Phase.STAMP,
            Reason.WRITE_POSITION_MISMATCH,
            BATCH_ROW=0,
            TABLE_ROW=1,
            SLOT=A_SLOTS[4],
            EXPECTED_POSITION=4,
            STORED_POSITION=5,
            EXPECTED_TOKEN=-1,
            STORED_TOKEN=15,
            STORED_LINK=link_of(A_LINKS[3], 15, 5),
            BAD_INDEX=-1,
        )
    ]
    # The record is written as given, so the next step's verify sees the wrong position too.
    assert records_at(canary, [A_SLOTS[4]]) == [(15, 5, link_of(A_LINKS[3], 15, 5))]
    nxt = make_batch(table, [1], [5], [1], [16], [5], [A_SLOTS[5]])
    later = run_step(canary, log, nxt)
    assert [(r["REASONS"], r["SLOT"], r["EXPECTED_POSITION"], r["STORED_POSITION"]) for r in later] == [
        (Reason.POSITION_MISMATCH, A_SLOTS[4], 4, 5)
    ]


def test_write_token_mismatch() -> None:
    truth = torch.zeros(3, 8, dtype=torch.int64)
    truth[1, :5] = torch.tensor(A_SEQ)
    truth[2, :4] = torch.tensor(B_SEQ)
    canary, log, table = two_requests()
    rows = run_step(canary, log, decode_both(table, ids=[16, B_SEQ[3]], truth=truth, truth_lens=[5, 4]))
    assert rows == [
        expect(
            Phase.STAMP,
            Reason.WRITE_TOKEN_MISMATCH,
            BATCH_ROW=0,
            TABLE_ROW=1,
            SLOT=A_SLOTS[4],
            EXPECTED_POSITION=4,
            STORED_POSITION=4,
            EXPECTED_TOKEN=15,
            STORED_TOKEN=16,
            STORED_LINK=link_of(A_LINKS[3], 16, 4),
            BAD_INDEX=-1,
        )
    ]


def test_row_out_of_range() -> None:
    canary, log, table = two_requests()
    batch = make_batch(table, [5, 2], [4, 3], [1, 1], [15, 34], [4, 3], [11, 23])
    rows = run_step(canary, log, batch, check_values=False)
    assert rows == [row(Phase.PLAN, Reason.ROW_OUT_OF_RANGE, 0, 5, -1, -1, 4, 5, -1, 0, 0, 0, 5)]
    ws = canary.workspace
    assert ws.row_state[:2].tolist() == [ws.ROW_BAD, ws.ROW_ACTIVE]
    assert ws.verify_offsets[:3].tolist() == [0, 0, 3]
    # B still runs, reading its own token (the bad row's token keeps its place).
    assert records_at(canary, [11, 23]) == [(0, 0, 0), (34, 3, B_LINKS[3])]


def test_length_out_of_range() -> None:
    canary, log, table = two_requests()
    # A claims a prefix of 8 in an 8-wide table (8 + 1 > 8); B's declared tokens run past input_ids.
    batch = make_batch(table, [1, 2], [8, 3], [1, 2], [15, 34], [4, 3], [11, 23])
    rows = run_step(canary, log, batch, check_values=False)
    plan_rows = [
        row(Phase.PLAN, Reason.LENGTH_OUT_OF_RANGE, 0, 1, -1, -1, 8, 9, -1, 0, 0, 0, -1),
        row(Phase.PLAN, Reason.LENGTH_OUT_OF_RANGE, 1, 2, -1, -1, 3, 5, -1, 0, 0, 0, -1),
    ]
    assert rows == plan_rows
    ws = canary.workspace
    assert ws.row_state[:2].tolist() == [ws.ROW_BAD, ws.ROW_BAD]
    assert int(log.counters[Counter.STAMPED]) == 7  # nothing stamped by bad rows
    # A negative prefix is a bad length too.
    canary, log, table = two_requests()
    rows = run_step(canary, log, make_batch(table, [1], [-1], [1], [15], [4], [11]), check_values=False)
    assert [(r["REASONS"], r["EXPECTED_POSITION"], r["STORED_POSITION"]) for r in rows] == [
        (Reason.LENGTH_OUT_OF_RANGE, -1, 0)
    ]


def test_every_reason_is_produced_above() -> None:
    # A compact ledger: the corruptions used above, replayed; together they raise every reason.
    seen = 0
    for probe in (_reason_probe_verify, _reason_probe_stamp, _reason_probe_plan, _reason_probe_same_step):
        seen |= probe()
    # digest_mismatch comes from the KV digest's bytes, not from records (tests/test_digest_*.py).
    record_reasons = ((1 << NUM_REASONS) - 1) & ~Reason.DIGEST_MISMATCH
    assert seen == record_reasons, [r.name for r in Reason if not seen & r & record_reasons]


def _counted(log: ViolationLog) -> int:
    return sum(1 << i for i in range(NUM_REASONS) if log.counters[i] > 0)


def _reason_probe_verify() -> int:
    bits = 0
    for corrupt in ("link", "position", "never", "reserved", "slot", "truth"):
        canary, log, table = two_requests()
        truth = truth_lens = None
        if corrupt == "link":
            canary.records.links[A_SLOTS[1]] = 3
        elif corrupt == "position":
            canary.records.positions[A_SLOTS[1]] = 9
        elif corrupt == "never":
            table[1, 1] = 30
        elif corrupt == "reserved":
            table[1, 1] = 39
        elif corrupt == "slot":
            table[1, 1] = 500
        else:
            truth = torch.zeros(3, 8, dtype=torch.int64)
            truth_lens = [5, 4]
        canary.step(decode_both(table, truth=truth, truth_lens=truth_lens), log)
        bits |= _counted(log)
    return bits


def _reason_probe_stamp() -> int:
    canary, log, table = two_requests()
    truth = torch.zeros(3, 8, dtype=torch.int64)
    canary.step(decode_both(table, pos=[9, 3], loc=[11, 0], truth=truth, truth_lens=[5, 4]), log)
    return _counted(log)


def _reason_probe_same_step() -> int:
    # A writes B's live slot 21 and B's own slot 23; B's table sends its new token to slot 27.
    canary, log, table = two_requests()
    table[2, 3] = 27
    canary.step(make_batch(table, [1, 2], [4, 3], [2, 1], [15, 1, 34], [4, 5, 3], [21, 23, 23]), log)
    return _counted(log)


def _reason_probe_plan() -> int:
    bits = 0
    canary, log, table = two_requests()
    canary.step(make_batch(table, [7, 1], [0, 9], [0, 0], [], [], []), log, check_values=False)
    bits |= _counted(log)
    canary, log, table, lookup, seq = lookup_world()
    lookup[14] = 99
    table[1, 3] = 40
    canary.step(make_batch(table, [1], [5], [1], [seq[5]], [5], [15], lookup=lookup), log, check_values=False)
    return bits | _counted(log)


# --------------------------------------------------------------------------- the log: first K, last K


def test_log_keeps_first_k_and_last_k_rows() -> None:
    canary = canary_for(FULL, log_rows=2)
    log = canary.new_log()
    table = two_table()
    # Prefill A into five slots outside the pool: five stamp rows (lifetime rows 0..4).
    run = canary.step
    run(make_batch(table, [1], [0], [5], A_SEQ, list(range(5)), [100, 101, 102, 103, 104]), log)
    # One append of five rows with K = 2: first gets rows 0, 1; last gets rows 3 (last[1]) and 4 (last[0]).
    assert [int(s) for s in log.first[:, Field.SLOT]] == [100, 101]
    assert [int(s) for s in log.last[:, Field.SLOT]] == [104, 103]
    assert [int(s) for s in log.rows()[:, Field.SLOT]] == [100, 101, 103, 104]
    table[1, :5] = torch.tensor([100, 101, 102, 103, 104])
    # Decode: the seed (row 5), five verify rows (6..10), one stamp row (11).
    run(make_batch(table, [1], [5], [1], [16], [5], [105]), log, check_values=False)
    assert log.total() == 12
    assert reason_counts(log) == {"SLOT_OUT_OF_RANGE": 11, "SEED_OUT_OF_RANGE": 1}
    first = [(int(r[Field.PHASE]), int(r[Field.SLOT])) for r in log.first]
    assert first == [(Phase.STAMP, 100), (Phase.STAMP, 101)]
    # Row i of the lifetime sits in last[i % K]: row 10 (verify of slot 104) in last[0], row 11 in last[1].
    last = [(int(r[Field.PHASE]), int(r[Field.SLOT])) for r in log.last]
    assert last == [(Phase.VERIFY, 104), (Phase.STAMP, 105)]
    kept = [(int(r[Field.PHASE]), int(r[Field.SLOT])) for r in log.rows()]
    assert kept == [(Phase.STAMP, 100), (Phase.STAMP, 101), (Phase.VERIFY, 104), (Phase.STAMP, 105)]
    # A fuller view: K = 64 keeps all eleven in order.
    canary = canary_for(FULL)
    big = canary.new_log()
    table = two_table()
    canary.step(make_batch(table, [1], [0], [5], A_SEQ, list(range(5)), [100, 101, 102, 103, 104]), big)
    table[1, :5] = torch.tensor([100, 101, 102, 103, 104])
    canary.step(make_batch(table, [1], [5], [1], [16], [5], [105]), big, check_values=False)
    all_rows = [(int(r[Field.PHASE]), int(r[Field.SLOT])) for r in big.rows()]
    stamps = [(Phase.STAMP, s) for s in range(100, 105)]
    verifies = [(Phase.VERIFY, s) for s in range(100, 105)]
    assert all_rows == [*stamps, (Phase.PLAN, -1), *verifies, (Phase.STAMP, 105)]
    assert torch.equal(log.rows(), big.rows()[[0, 1, 10, 11]])


def test_log_with_fewer_rows_than_k_and_between_k_and_2k() -> None:
    canary = canary_for(FULL, log_rows=4)
    log = canary.new_log()
    table = two_table()
    canary.step(make_batch(table, [1], [0], [3], A_SEQ[:3], [0, 1, 2], [100, 101, 102]), log)
    assert [int(r[Field.SLOT]) for r in log.rows()] == [100, 101, 102]
    canary.step(make_batch(table, [1], [0], [3], A_SEQ[:3], [0, 1, 2], [103, 104, 105]), log)
    # Six rows with K = 4: first holds 0..3, last holds 2..5, rows() shows each once.
    assert [int(r[Field.SLOT]) for r in log.first] == [100, 101, 102, 103]
    assert [int(r[Field.SLOT]) for r in log.rows()] == [100, 101, 102, 103, 104, 105]
