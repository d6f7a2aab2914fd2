"""Same-step write checks of the reference: a write into a slot read live this step, a slot written
twice, a new token's table entry that leads elsewhere, each reported at the write's own step.

Each fault case fails on the code before these checks (nothing was reported at this step) and its
clean twin stays silent.
"""

from __future__ import annotations

import torch

from kvcanary import CanaryGroup, GroupKind
from kvcanary.schema import Phase, Reason
from reference_helpers import (
    A_SEQ,
    A_SLOTS,
    B_SEQ,
    B_SLOTS,
    FULL,
    canary_for,
    chain,
    expect,
    link_of,
    make_batch,
    run_step,
    two_requests,
)

A_LINKS = chain(A_SEQ)
B_LINKS = chain(B_SEQ)


def stamp_row(reasons: Reason, batch_row: int, slot: int, pos: int, tok: int, link: int, **kw: int) -> dict[str, int]:
    fields = {
        "BATCH_ROW": batch_row,
        "TABLE_ROW": batch_row + 1,
        "SLOT": slot,
        "EXPECTED_POSITION": pos,
        "STORED_POSITION": pos,
        "EXPECTED_TOKEN": -1,
        "STORED_TOKEN": tok,
        "STORED_LINK": link,
        "BAD_INDEX": -1,
    }
    return expect(Phase.STAMP, reasons, **(fields | kw))


def test_write_into_another_requests_live_slot_is_reported_at_its_own_step() -> None:
    canary, log, table = two_requests()
    # A's decode writes B's position 1 (slot 21), which B reads this very step; A's table agrees.
    table[1, 4] = B_SLOTS[1]
    rows = run_step(canary, log, make_batch(table, [1, 2], [4, 3], [1, 1], [A_SEQ[4], B_SEQ[3]], [4, 3], [21, 23]))
    # The row names B, whose read the write hits (the request to fail); BAD_INDEX is A, the writing row.
    assert rows == [
        stamp_row(
            Reason.WRITE_INTO_LIVE_SLOT, 1, B_SLOTS[1], 4, A_SEQ[4], link_of(A_LINKS[3], A_SEQ[4], 4), BAD_INDEX=0
        )
    ]


def test_write_into_the_requests_own_earlier_position() -> None:
    canary, log, table = two_requests()
    table[1, 4] = A_SLOTS[1]  # A's position 4 lands on its own position 1
    rows = run_step(canary, log, make_batch(table, [1], [4], [1], [A_SEQ[4]], [4], [A_SLOTS[1]]))
    assert [(r["REASONS"], r["PHASE"], r["SLOT"]) for r in rows] == [
        (Reason.WRITE_INTO_LIVE_SLOT, Phase.STAMP, A_SLOTS[1])
    ]


def test_a_slot_written_twice_reports_every_writer() -> None:
    canary, log, table = two_requests()
    # A and B both write slot 11 (A's own position 4), B's table agreeing: two writers, no live read.
    table[2, 3] = A_SLOTS[4]
    rows = run_step(canary, log, make_batch(table, [1, 2], [4, 3], [1, 1], [A_SEQ[4], B_SEQ[3]], [4, 3], [11, 11]))
    assert rows == [
        stamp_row(Reason.DUPLICATE_WRITE, 0, 11, 4, A_SEQ[4], link_of(A_LINKS[3], A_SEQ[4], 4)),
        stamp_row(Reason.DUPLICATE_WRITE, 1, 11, 3, B_SEQ[3], link_of(B_LINKS[2], B_SEQ[3], 3)),
    ]


def test_one_request_writing_one_slot_twice_in_a_chunk() -> None:
    canary = canary_for(FULL)
    log = canary.new_log()
    table = torch.zeros(2, 8, dtype=torch.int32)
    table[1, :4] = torch.tensor([5, 6, 5, 8])  # positions 0 and 2 share slot 5
    rows = run_step(canary, log, make_batch(table, [1], [0], [4], [1, 2, 3, 4], [0, 1, 2, 3], [5, 6, 5, 8]))
    assert [(r["REASONS"], r["EXPECTED_POSITION"]) for r in rows] == [
        (Reason.DUPLICATE_WRITE, 0),
        (Reason.DUPLICATE_WRITE, 2),
    ]


def test_new_token_read_entry_that_leads_elsewhere() -> None:
    canary, log, table = two_requests()
    table[2, 3] = 30  # B's new token is read from slot 30 but written to slot 23
    rows = run_step(canary, log, make_batch(table, [1, 2], [4, 3], [1, 1], [A_SEQ[4], B_SEQ[3]], [4, 3], [11, 23]))
    assert rows == [
        stamp_row(Reason.NEW_READ_MISMATCH, 1, 23, 3, B_SEQ[3], link_of(B_LINKS[2], B_SEQ[3], 3), BAD_INDEX=30)
    ]
    # The same batch on a group that does not hold new tokens in its table: not checked.
    group = CanaryGroup(num_slots=40, reserved_slots=(0, 39), padding_row=0, checks_new_reads=False)
    canary, log, table = two_requests(group)
    table[2, 3] = 30
    assert (
        run_step(canary, log, make_batch(table, [1, 2], [4, 3], [1, 1], [A_SEQ[4], B_SEQ[3]], [4, 3], [11, 23])) == []
    )


def test_reserved_new_read_entry_is_exempt() -> None:
    canary, log, table = two_requests()
    table[2, 3] = 39  # a sentinel: the engine reads the new token from outside the pool
    assert (
        run_step(canary, log, make_batch(table, [1, 2], [4, 3], [1, 1], [A_SEQ[4], B_SEQ[3]], [4, 3], [11, 23])) == []
    )


def test_clean_decode_and_chunk_stay_silent() -> None:
    canary, log, table = two_requests()
    assert (
        run_step(canary, log, make_batch(table, [1, 2], [4, 3], [1, 1], [A_SEQ[4], B_SEQ[3]], [4, 3], [11, 23])) == []
    )
    assert run_step(canary, log, make_batch(table, [2], [4], [2], [7, 8], [4, 5], [24, 25])) == []


# --------------------------------------------------------------------------- sliding window ring

RING = CanaryGroup(
    num_slots=16, kind=GroupKind.SLIDING_WINDOW, window=3, reserved_slots=(0,), padding_row=0, name="ring"
)
RING_SEQ = [40 + i for i in range(12)]


def _ring_table(ring: int = 4) -> torch.Tensor:
    """Row 1: position p in slot 1 + p % ring (a ring of window + 1 slots)."""
    table = torch.zeros(2, 12, dtype=torch.int32)
    table[1] = torch.tensor([1 + p % ring for p in range(12)])
    return table


def _ring_step(canary, log, table, pre: int, ext: int, loc: list[int] | None = None):  # type: ignore[no-untyped-def]
    pos = list(range(pre, pre + ext))
    loc = [int(table[1, p]) for p in pos] if loc is None else loc
    return run_step(canary, log, make_batch(table, [1], [pre], [ext], [RING_SEQ[p] for p in pos], pos, loc))


def test_ring_overwrite_of_the_oldest_position_is_legal() -> None:
    canary = canary_for(RING)
    log = canary.new_log()
    table = _ring_table()
    assert _ring_step(canary, log, table, 0, 4) == []  # fills the ring
    for pre in range(4, 8):  # decodes: each overwrites position pre - 4, just out of the window
        assert _ring_step(canary, log, table, pre, 1) == []
    # A two-token chunk: position 9 overwrites position 5's slot, which the verify span [5, 8) holds.
    assert _ring_step(canary, log, table, 8, 2) == []
    # A chunk as long as the ring: each token overwrites a position of the span it no longer sees.
    canary = canary_for(RING)
    log = canary.new_log()
    assert _ring_step(canary, log, table, 0, 4) == []
    assert _ring_step(canary, log, table, 4, 1) == []
    assert _ring_step(canary, log, table, 5, 1) == []
    assert _ring_step(canary, log, table, 6, 4) == []


def test_ring_write_into_a_position_still_in_the_window_is_reported() -> None:
    canary = canary_for(RING)
    log = canary.new_log()
    table = _ring_table()
    assert _ring_step(canary, log, table, 0, 4) == []
    assert _ring_step(canary, log, table, 4, 1) == []
    # Position 5 written into position 3's slot: position 3 is still in the window [2, 5).
    table[1, 5] = table[1, 3]
    rows = _ring_step(canary, log, table, 5, 1)
    assert [(r["REASONS"], r["SLOT"], r["EXPECTED_POSITION"]) for r in rows] == [
        (Reason.WRITE_INTO_LIVE_SLOT, int(table[1, 3]), 5)
    ]
