"""Independent scalar oracle of plan, verify and stamp: plain Python ints, one loop per request and token.

Written from the documented semantics (the reference's docstrings, ``schema.Field`` and
``docs/design.md``), not from the vectorised code.  Tensors are read into lists on entry and written
back on exit; everything in between is Python.  Links are kept unsigned and chained one token at a
time with :func:`kvcanary.hashing.link_step`, the scalar spec, so a wrong closed-form scan in the
reference shows up as a difference.  Used only by the tests.  Plan and verify live here, the stamp in
:mod:`oracle_stamp` (re-exported), the batch and log as lists in :mod:`oracle_state`.
"""

from __future__ import annotations

import dataclasses

import torch

from kvcanary.batch import StepBatch
from kvcanary.hashing import EMPTY_LINK, LINK_ANCHOR, link_step, to_signed64, to_unsigned64
from kvcanary.layout import CanaryGroup, RecordStore
from kvcanary.schema import NOT_STORED, UNKNOWN_TOKEN, Counter, Phase, Reason
from kvcanary.workspace import PlanWorkspace, ViolationLog
from oracle_stamp import stamp
from oracle_state import (
    ROW_ACTIVE,
    ROW_BAD,
    ROW_PADDING,
    Batch,
    Log,
    Rewrites,
    expected_token,
    ints,
    table_index,
    to_pool,
    violation_row,
)

# --------------------------------------------------------------------------- plan


def plan(group: CanaryGroup, batch: StepBatch, records: RecordStore, ws: PlanWorkspace, log: ViolationLog) -> None:
    b = Batch.read(batch)
    links = ints(records.links)
    out = Log(log)
    bs = len(b.rows)
    n_rows = len(b.table)
    width = b.table_width * group.page_size
    n_tokens = len(b.input_ids)

    verify_offsets, write_offsets = [0], [0]
    starts, seeds, states = [], [], []
    for r in range(bs):
        row, pre, ext = b.rows[r], b.prefix[r], b.extend[r]
        # Every row's tokens occupy its stretch of the flat token list, whatever the row is.
        write_offsets.append(write_offsets[-1] + max(ext, 0))
        padding = group.padding_row is not None and row == group.padding_row
        row_bad = not padding and not 0 <= row < n_rows
        len_bad = (
            not padding and not row_bad and (pre < 0 or ext < 0 or pre + ext > width or write_offsets[-1] > n_tokens)
        )
        active = not (padding or row_bad or len_bad)

        start = 0
        if active and group.window > 0:
            start = max(pre - group.window, 0)
        verify_offsets.append(verify_offsets[-1] + (pre - start if active else 0))

        reasons, bad_index = 0, -1
        if row_bad:
            reasons, bad_index = Reason.ROW_OUT_OF_RANGE, row
        if len_bad:
            reasons |= Reason.LENGTH_OUT_OF_RANGE
        seed = LINK_ANCHOR
        if active and ext > 0 and pre > 0:
            seed, seed_reasons, seed_bad = _seed(group, b, links, row, pre)
            if seed_reasons:
                reasons, bad_index = reasons | seed_reasons, seed_bad
        starts.append(start)
        seeds.append(seed)
        states.append(ROW_PADDING if padding else ROW_ACTIVE if active else ROW_BAD)
        if reasons:
            out.append(violation_row(
                Phase.PLAN, group, REASONS=reasons, BATCH_ROW=r, TABLE_ROW=row, SLOT=-1, PRED=-1,
                EXPECTED_POSITION=pre, STORED_POSITION=pre + ext, BAD_INDEX=bad_index,
            ))  # fmt: skip
    out.counters[Counter.CALLS] += 1

    ws.verify_offsets[: bs + 1] = torch.tensor(verify_offsets, dtype=torch.int64)
    ws.write_offsets[: bs + 1] = torch.tensor(write_offsets, dtype=torch.int64)
    ws.window_starts[:bs] = torch.tensor(starts, dtype=torch.int64)
    ws.seed_links[:bs] = torch.tensor([to_signed64(s) for s in seeds], dtype=torch.int64)
    ws.row_state[:bs] = torch.tensor(states, dtype=torch.int32)
    ws.epoch[0] = int(ws.epoch[0]) + 1  # a new step
    out.write_back(log)


def _seed(group: CanaryGroup, b: Batch, links: list[int], row: int, pre: int) -> tuple[int, int, int]:
    """(seed link, reasons, index they report) of a row that continues its chain from the stored link of its
    last cached position ``pre - 1``."""
    full = table_index(group, b, row, pre - 1)
    slot, lookup_bad = to_pool(b, full)
    if lookup_bad:
        return LINK_ANCHOR, Reason.LOOKUP_OUT_OF_RANGE, full
    if not 0 <= slot < len(links):
        return LINK_ANCHOR, Reason.SEED_OUT_OF_RANGE, slot
    if slot not in group.reserved_slots and links[slot] != EMPTY_LINK:
        return to_unsigned64(links[slot]), 0, -1
    return LINK_ANCHOR, 0, -1


def _mark(ws: PlanWorkspace) -> int:
    """This step's mark: 1 + epoch mod the period (never 0, the value of a fresh mark)."""
    return 1 + int(ws.epoch[0]) % PlanWorkspace.MARK_PERIOD


def _mark_writes(group: CanaryGroup, b: Batch, ws: PlanWorkspace, n_slots: int) -> None:
    """Every slot a token of an active row stores into: 2 * mark, + 1 when two or more tokens do."""
    offsets = ints(ws.write_offsets[: len(b.rows) + 1])
    states = ints(ws.row_state[: len(b.rows)])
    writers: dict[int, int] = {}
    for r in range(len(b.rows)):
        if states[r] != ROW_ACTIVE:
            continue
        for t in range(offsets[r], min(offsets[r + 1], len(b.input_ids))):
            if b.out_loc[t] == NOT_STORED:
                continue
            slot, lookup_bad = to_pool(b, b.out_loc[t])
            if not lookup_bad and 0 <= slot < n_slots and slot not in group.reserved_slots:
                writers[slot] = writers.get(slot, 0) + 1
    for slot, n in writers.items():
        ws.write_marks[slot] = 2 * _mark(ws) + (1 if n > 1 else 0)


# --------------------------------------------------------------------------- verify


@dataclasses.dataclass
class _Records:
    """The record store as lists, and what verify needs beside it."""

    tokens: list[int]
    positions: list[int]
    links: list[int]
    reserved: set[int]

    def readable(self, slot: int) -> bool:
        return 0 <= slot < len(self.links)


def verify(
    group: CanaryGroup,
    batch: StepBatch,
    records: RecordStore,
    ws: PlanWorkspace,
    log: ViolationLog,
    capacity: int,
) -> None:
    b = Batch.read(batch)
    bs = len(b.rows)
    rec = _Records(ints(records.tokens), ints(records.positions), ints(records.links), set(group.reserved_slots))
    offsets = ints(ws.verify_offsets[: bs + 1])
    starts = ints(ws.window_starts[:bs])
    out = Log(log)
    checked_entries = 0
    read_live: dict[int, int] = {}
    for r in range(bs):
        for k in range(offsets[r + 1] - offsets[r]):
            if checked_entries == capacity:
                break
            checked_entries += 1
            row = _verify_entry(group, b, rec, r, starts[r] + k, read_live)
            if row is not None:
                out.append(row)
    epoch = int(ws.epoch[0])
    for slot, r in read_live.items():  # the lowest batch row that read it; kept over older steps' marks
        ws.read_marks[slot] = max(int(ws.read_marks[slot]), PlanWorkspace.read_mark(epoch, r))
    _mark_writes(group, b, ws, len(rec.links))
    out.counters[Counter.VERIFIED] += checked_entries
    out.counters[Counter.SKIPPED] += offsets[bs] - checked_entries
    out.counters[Counter.CALLS] += 1
    out.write_back(log)


def _verify_entry(
    group: CanaryGroup, b: Batch, rec: _Records, r: int, pos: int, read_live: dict[int, int]
) -> list[int] | None:
    """The violation row of batch row ``r``'s read of position ``pos``, or None; notes the slots read."""
    row = b.rows[r]
    full = table_index(group, b, row, pos)
    slot, lookup_bad = to_pool(b, full)
    readable = not lookup_bad and rec.readable(slot)
    s_tok, s_pos, s_link = (rec.tokens[slot], rec.positions[slot], rec.links[slot]) if readable else (0, 0, 0)
    is_reserved = readable and slot in rec.reserved
    never = readable and not is_reserved and s_link == EMPTY_LINK
    if readable and not is_reserved:
        read_live.setdefault(slot, r)  # attention gathers it this step (rows come in order)
    checked = readable and not is_reserved and not never
    exp_tok = expected_token(group, b, r, pos)

    reasons = 0
    bad_index = -1
    if lookup_bad:
        reasons |= Reason.LOOKUP_OUT_OF_RANGE
        bad_index = full
    elif not readable:
        reasons |= Reason.SLOT_OUT_OF_RANGE
        bad_index = slot
    if is_reserved:
        reasons |= Reason.RESERVED_SLOT
    if never:
        reasons |= Reason.NEVER_WRITTEN
    if checked and s_pos != pos:
        reasons |= Reason.POSITION_MISMATCH
    if checked and exp_tok != UNKNOWN_TOKEN and s_tok != exp_tok:
        reasons |= Reason.TOKEN_MISMATCH
    pred, prev_link, pred_reasons, pred_bad = _predecessor(group, b, rec, row, pos)
    if checked and pred_reasons:
        reasons |= pred_reasons
        if bad_index == -1:
            bad_index = pred_bad
    exp_link = 0
    if checked and prev_link is not None:
        exp_link = to_signed64(link_step(prev_link, s_tok, s_pos))
        if exp_link != s_link:
            reasons |= Reason.LINK_MISMATCH
    if not reasons:
        return None
    return violation_row(
        Phase.VERIFY, group, REASONS=reasons, BATCH_ROW=r, TABLE_ROW=row, SLOT=slot, PRED=pred,
        EXPECTED_POSITION=pos, STORED_POSITION=s_pos, EXPECTED_TOKEN=exp_tok, STORED_TOKEN=s_tok,
        EXPECTED_LINK=exp_link, STORED_LINK=s_link, BAD_INDEX=bad_index,
    )  # fmt: skip


def _predecessor(group: CanaryGroup, b: Batch, rec: _Records, row: int, pos: int) -> tuple[int, int | None, int, int]:
    """Position ``pos - 1`` of table row ``row``: (its slot for PRED, its link to chain from or None where
    it cannot be read, the reasons it gives a checked entry, the index those report).  The link is
    recomputed from the predecessor's stored link and the entry's own fields."""
    if pos == 0:
        return -1, LINK_ANCHOR, 0, -1
    pfull = table_index(group, b, row, pos - 1)
    pslot, plookup_bad = to_pool(b, pfull)
    if plookup_bad:
        return -1, None, Reason.LOOKUP_OUT_OF_RANGE, pfull
    if not rec.readable(pslot):
        return pslot, None, Reason.PREDECESSOR_OUT_OF_RANGE, pslot
    return pslot, None if pslot in rec.reserved else rec.links[pslot], 0, -1


def step(
    group: CanaryGroup,
    batch: StepBatch,
    records: RecordStore,
    ws: PlanWorkspace,
    log: ViolationLog,
    capacity: int,
) -> Rewrites:
    """plan, verify, stamp; returns the slots stamped more than once this step (see :func:`stamp`)."""
    plan(group, batch, records, ws, log)
    verify(group, batch, records, ws, log, capacity)
    return stamp(group, batch, records, ws, log)
