"""The scalar oracle's stamp: each stored token checked against what the step reads, then recorded.

Part of :mod:`oracle` (which re-exports :func:`stamp`); same conventions: plain Python ints, one loop
per token.
"""

from __future__ import annotations

import torch

from kvcanary.batch import StepBatch
from kvcanary.hashing import link_step, to_signed64, to_unsigned64
from kvcanary.layout import CanaryGroup, RecordStore
from kvcanary.schema import NOT_STORED, UNKNOWN_TOKEN, Counter, Phase, Reason
from kvcanary.workspace import PlanWorkspace, ViolationLog
from oracle_state import (
    ROW_ACTIVE,
    Batch,
    Log,
    Rewrites,
    expected_token,
    i32,
    ints,
    table_index,
    to_pool,
    violation_row,
)

# --------------------------------------------------------------------------- stamp


def stamp(group: CanaryGroup, batch: StepBatch, records: RecordStore, ws: PlanWorkspace, log: ViolationLog) -> Rewrites:
    """Stamp the step's tokens one at a time.

    Returns the slots written more than once, each with every (token, position, link) written to it:
    which of them the slot ends up holding is unspecified.
    """
    b = Batch.read(batch)
    bs = len(b.rows)
    tokens, positions, links = ints(records.tokens), ints(records.positions), ints(records.links)
    n_slots = len(links)
    reserved = set(group.reserved_slots)
    offsets = ints(ws.write_offsets[: bs + 1])
    seeds = ints(ws.seed_links[:bs])
    states = ints(ws.row_state[:bs])
    out = Log(log)
    written: Rewrites = {}
    marks = (int(ws.epoch[0]), ints(ws.read_marks), ints(ws.write_marks), list(positions))  # as verify saw them

    for r in range(bs):
        if states[r] != ROW_ACTIVE:
            continue
        link = to_unsigned64(seeds[r])
        for i in range(offsets[r + 1] - offsets[r]):
            t = offsets[r] + i
            if t >= len(b.input_ids):
                break
            tok, pos = i32(b.input_ids[t]), b.positions[t]
            link = link_step(link, tok, i32(pos))  # chained even when the token is not stored
            exp_pos = b.prefix[r] + i
            exp_tok = expected_token(group, b, r, exp_pos)
            full = b.out_loc[t]

            named = r
            slot, reasons, bad_index = _write_target(b, full, n_slots, reserved)
            if reasons == 0 and slot >= 0:
                tokens[slot], positions[slot], links[slot] = tok, i32(pos), to_signed64(link)
                written.setdefault(slot, []).append((tok, i32(pos), to_signed64(link)))
                reasons, bad_index, named = _same_step(group, b, marks, r, exp_pos, slot)
            if pos != exp_pos:
                reasons |= Reason.WRITE_POSITION_MISMATCH
            if exp_tok != UNKNOWN_TOKEN and tok != exp_tok:
                reasons |= Reason.WRITE_TOKEN_MISMATCH
            if reasons:
                out.append(violation_row(
                    Phase.STAMP, group, REASONS=reasons, BATCH_ROW=named, TABLE_ROW=b.rows[named], SLOT=slot,
                    PRED=-1, EXPECTED_POSITION=exp_pos, STORED_POSITION=pos, EXPECTED_TOKEN=exp_tok,
                    STORED_TOKEN=tok, STORED_LINK=to_signed64(link), BAD_INDEX=bad_index,
                ))  # fmt: skip
    out.counters[Counter.STAMPED] += sum(len(w) for w in written.values())
    out.counters[Counter.CALLS] += 1
    out.write_back(log)
    records.tokens.copy_(torch.tensor(tokens, dtype=torch.int32))
    records.positions.copy_(torch.tensor(positions, dtype=torch.int32))
    records.links.copy_(torch.tensor(links, dtype=torch.int64))
    return {s: w for s, w in written.items() if len(w) > 1}


def _write_target(b: Batch, full: int, n_slots: int, reserved: set[int]) -> tuple[int, int, int]:
    """(slot, reasons, index they report) of a token stored at table index ``full``: reasons 0 with a slot
    >= 0 means the record is written; NOT_STORED gives (-1, 0, -1)."""
    if full == NOT_STORED:
        return -1, 0, -1
    slot, lookup_bad = to_pool(b, full)
    if lookup_bad:
        return slot, Reason.LOOKUP_OUT_OF_RANGE, full
    if not 0 <= slot < n_slots:
        return slot, Reason.SLOT_OUT_OF_RANGE, slot
    if slot in reserved:
        return slot, Reason.RESERVED_SLOT, -1
    return slot, 0, -1


def _same_step(
    group: CanaryGroup, b: Batch, marks: tuple[int, list[int], list[int], list[int]], r: int, pos: int, slot: int
) -> tuple[int, int, int]:
    """Reasons of a token of batch row ``r`` stored at ``slot`` for KV position ``pos``, against what this
    step reads; its BAD_INDEX (a live write: the writer's batch row; else the table entry of its own
    position when that leads elsewhere; else -1) and the batch row its log row names (a live write: the
    lowest row reading the slot)."""
    epoch, read_marks, write_marks, old_positions = marks
    mark = 1 + epoch % PlanWorkspace.MARK_PERIOD
    limit = PlanWorkspace.READER_LIMIT
    n_slots = len(read_marks)
    row, pre = b.rows[r], b.prefix[r]
    reasons, bad_index, named = 0, -1, r
    live = False
    if read_marks[slot] >> PlanWorkspace.READER_BITS == epoch:
        # A window's ring: the token may reuse the slot of a position of its own row's window that it no
        # longer attends to (the position the slot held when verify read it).
        q = old_positions[slot]
        ring = False
        if group.window > 0 and max(pre - group.window, 0) <= q < pre and q < pos - group.window:
            own, own_bad = to_pool(b, table_index(group, b, row, q))
            ring = not own_bad and own == slot
        if not ring:
            reasons |= Reason.WRITE_INTO_LIVE_SLOT
            live = True
            named = limit - 1 - (read_marks[slot] & (limit - 1))
    if write_marks[slot] == 2 * mark + 1:
        reasons |= Reason.DUPLICATE_WRITE
    if group.checks_new_reads:
        entry = table_index(group, b, row, pos)
        read, read_bad = to_pool(b, entry)
        exempt = not read_bad and 0 <= read < n_slots and read in group.reserved_slots
        if not exempt and (read_bad or read != slot):
            reasons |= Reason.NEW_READ_MISMATCH
            bad_index = entry
    if live:
        bad_index = r
    return reasons, bad_index, named
