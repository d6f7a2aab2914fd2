"""Hand-written reference cases: lookups, write-side mismatches, rows and lengths out of range, and a
ledger showing that the corruptions of these cases raise every record reason.

Conventions as in :mod:`test_reference_cases`.
"""

from __future__ import annotations

import torch

from kvcanary import CanaryGroup, GroupCanary, GroupKind, ViolationLog
from kvcanary.schema import NUM_REASONS, Counter, Phase, Reason
from reference_helpers import (
    A_LINKS,
    A_SEQ,
    A_SLOTS,
    ANCHOR,
    B_LINKS,
    B_SEQ,
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
)

# --------------------------------------------------------------------------- lookups, writes, rows, lengths


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


def test_the_corruptions_of_these_cases_raise_every_record_reason() -> None:
    # A compact ledger: the corruptions of the reference case files, replayed; together they raise every reason.
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
