"""Hand-written reference cases: every corrupt record or mapping logged field by field, and out-of-range
slots and predecessors.

Conventions as in :mod:`test_reference_cases`.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvcanary import CanaryGroup, GroupCanary
from kvcanary.schema import Counter, Phase, Reason
from reference_helpers import (
    A_LINKS,
    A_SLOTS,
    B_LINKS,
    B_SLOTS,
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
    verify_row,
)

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
