"""Shared by the reference tests: batches, a canary on the reference path, expected rows field by field,
and two clean requests (A and B) that most cases corrupt.

Expected links are computed with the scalar spec (:func:`kvcanary.hashing.link_step`).  The conventions of
the row fields are those of :class:`kvcanary.schema.Field`: plan rows have no slot (-1) and carry prefix /
prefix+extend as positions; stamp rows have no predecessor (-1) and no expected link (0).
"""

from __future__ import annotations

import torch

from kvcanary import Backend, CanaryGroup, Capacities, GroupCanary, StepBatch, ViolationLog
from kvcanary.hashing import LINK_ANCHOR, link_step, to_signed64
from kvcanary.schema import NUM_REASONS, Field, Phase, Reason

ANCHOR = to_signed64(LINK_ANCHOR)


def chain(tokens: list[int], positions: list[int] | None = None, seed: int = LINK_ANCHOR) -> list[int]:
    """Signed links of consecutive records chained from ``seed`` (scalar spec)."""
    positions = list(range(len(tokens))) if positions is None else positions
    out, link = [], seed
    for tok, pos in zip(tokens, positions, strict=True):
        link = link_step(link, tok, pos)
        out.append(to_signed64(link))
    return out


def link_of(prev_signed: int, tok: int, pos: int) -> int:
    return to_signed64(link_step(prev_signed, tok, pos))


def t64(values: list[int] | list[list[int]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def make_batch(
    table: torch.Tensor,
    rows: list[int],
    prefix: list[int],
    extend: list[int],
    ids: list[int],
    pos: list[int],
    loc: list[int],
    *,
    truth: torch.Tensor | None = None,
    truth_lens: list[int] | None = None,
    lookup: torch.Tensor | None = None,
) -> StepBatch:
    return StepBatch(
        rows=t64(rows),
        prefix_lens=t64(prefix),
        extend_lens=t64(extend),
        table=table,
        input_ids=t64(ids),
        positions=t64(pos),
        out_cache_loc=t64(loc),
        truth=truth,
        truth_lens=None if truth_lens is None else t64(truth_lens),
        lookup=lookup,
    )


def canary_for(group: CanaryGroup, *, verify_entries: int = 256, log_rows: int = 64) -> GroupCanary:
    caps = Capacities(max_batch=8, max_tokens=64, verify_entries=verify_entries, log_rows=log_rows)
    return GroupCanary(group, caps, backend=Backend.REFERENCE)


def new_rows(log: ViolationLog, since: int) -> list[dict[str, int]]:
    """Rows appended after the first ``since`` (the log must not have wrapped), as field-name dicts."""
    rows = log.rows()[since:]
    return [{f.name: int(r[f]) for f in Field} for r in rows]


def expect(phase: Phase, reasons: Reason, *, group: int = 0, **fields: int) -> dict[str, int]:
    """A full expected row; only the per-phase constants may be left out."""
    row = {"REASONS": int(reasons), "PHASE": int(phase), "GROUP": group}
    if phase is Phase.PLAN:
        row |= {"SLOT": -1, "PRED": -1, "EXPECTED_TOKEN": -1, "STORED_TOKEN": 0, "EXPECTED_LINK": 0, "STORED_LINK": 0}
    if phase is Phase.STAMP:
        row |= {"PRED": -1, "EXPECTED_LINK": 0}
    row |= fields
    missing = {f.name for f in Field} - set(row)
    if missing:
        raise TypeError(f"expected row lacks {sorted(missing)}")
    return row


def row(
    phase: Phase,
    reasons: Reason,
    batch_row: int,
    table_row: int,
    slot: int,
    pred: int,
    expected_position: int,
    stored_position: int,
    expected_token: int,
    stored_token: int,
    expected_link: int,
    stored_link: int,
    bad_index: int,
    *,
    group: int = 0,
) -> dict[str, int]:
    """A full expected row, its fields in :class:`~kvcanary.schema.Field` order: one line of a table."""
    return expect(
        phase, reasons, group=group, BATCH_ROW=batch_row, TABLE_ROW=table_row, SLOT=slot, PRED=pred,
        EXPECTED_POSITION=expected_position, STORED_POSITION=stored_position, EXPECTED_TOKEN=expected_token,
        STORED_TOKEN=stored_token, EXPECTED_LINK=expected_link, STORED_LINK=stored_link, BAD_INDEX=bad_index,
    )  # fmt: skip


def reason_counts(log: ViolationLog) -> dict[str, int]:
    return {Reason(1 << i).name or "": int(log.counters[i]) for i in range(NUM_REASONS) if log.counters[i]}


def records_at(canary: GroupCanary, slots: list[int]) -> list[tuple[int, int, int]]:
    r = canary.records
    return [(int(r.tokens[s]), int(r.positions[s]), int(r.links[s])) for s in slots]


# --------------------------------------------------------------------------- two requests, reused below

FULL = CanaryGroup(num_slots=40, reserved_slots=(0, 39), padding_row=0)
A_SLOTS = [5, 9, 2, 7, 11, 3]  # table row 1: deliberately not monotonic
B_SLOTS = [20, 21, 22, 23, 24, 25, 26, 27]  # table row 2
A_SEQ = [11, 12, 13, 14, 15]
B_SEQ = [31, 32, 33, 34]
A_LINKS = chain(A_SEQ)
B_LINKS = chain(B_SEQ)


def two_table() -> torch.Tensor:
    table = torch.zeros(3, 8, dtype=torch.int32)
    table[1, : len(A_SLOTS)] = torch.tensor(A_SLOTS)
    table[2] = torch.tensor(B_SLOTS)
    return table


def two_requests(group: CanaryGroup = FULL, **kw: int) -> tuple[GroupCanary, ViolationLog, torch.Tensor]:
    """A has prefilled positions 0..3, B positions 0..2; both clean."""
    canary = canary_for(group, **kw)
    log = canary.new_log()
    table = two_table()
    canary.step(
        make_batch(
            table,
            [1, 2],
            [0, 0],
            [4, 3],
            A_SEQ[:4] + B_SEQ[:3],
            [0, 1, 2, 3, 0, 1, 2],
            A_SLOTS[:4] + B_SLOTS[:3],
        ),
        log,
    )
    assert log.total() == 0
    return canary, log, table


def decode_both(table: torch.Tensor, **kw: object) -> StepBatch:
    """A decodes position 4 (slot 11), B decodes position 3 (slot 23)."""
    args: dict[str, object] = {"ids": [A_SEQ[4], B_SEQ[3]], "pos": [4, 3], "loc": [A_SLOTS[4], B_SLOTS[3]]}
    args |= kw
    return make_batch(table, [1, 2], [4, 3], [1, 1], **args)  # type: ignore[arg-type]


def run_step(
    canary: GroupCanary, log: ViolationLog, batch: StepBatch, *, check_values: bool = True
) -> list[dict[str, int]]:
    since = log.total()
    canary.step(batch, log, check_values=check_values)
    return new_rows(log, since)


def verify_row(reasons: Reason, batch_row: int, pos: int, slot: int, pred: int, **kw: int) -> dict[str, int]:
    table_row = 1 if batch_row == 0 else 2
    return expect(
        Phase.VERIFY,
        reasons,
        BATCH_ROW=batch_row,
        TABLE_ROW=table_row,
        SLOT=slot,
        PRED=pred,
        EXPECTED_POSITION=pos,
        **({"EXPECTED_TOKEN": -1, "BAD_INDEX": -1} | kw),
    )
