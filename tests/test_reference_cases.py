"""Hand-written cases for the reference plan -> verify -> stamp, with exact records and log rows.

Expected links are computed here with the scalar spec (:func:`kvcanary.hashing.link_step`); every
violation row is compared field by field.  The conventions of the row fields are those of
:class:`kvcanary.schema.Field`: plan rows have no slot (-1) and carry prefix / prefix+extend as
positions; stamp rows have no predecessor (-1) and no expected link (0).
"""

from __future__ import annotations

import torch

from kvcanary import CanaryGroup
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
