"""Hand-written reference cases: sliding-window rings, draft groups and the ground truth's valid lengths.

Conventions as in :mod:`test_reference_cases`.
"""

from __future__ import annotations

import torch

from kvcanary import CanaryGroup, GroupCanary, GroupKind
from kvcanary.schema import Counter, Phase, Reason
from reference_helpers import (
    A_SEQ,
    B_LINKS,
    B_SEQ,
    canary_for,
    chain,
    decode_both,
    expect,
    link_of,
    make_batch,
    records_at,
    row,
    run_step,
    two_requests,
)

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
