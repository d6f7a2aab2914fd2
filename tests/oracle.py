"""Independent scalar oracle of plan, verify and stamp: plain Python ints, one loop per request and token.

Written from the documented semantics (the reference's docstrings, ``schema.Field`` and
``docs/design.md``), not from the vectorised code.  Tensors are read into lists on entry and written
back on exit; everything in between is Python.  Links are kept unsigned and chained one token at a
time with :func:`kvcanary.hashing.link_step`, the scalar spec, so a wrong closed-form scan in the
reference shows up as a difference.  Used only by the tests.
"""

from __future__ import annotations

import dataclasses

import torch

from kvcanary.batch import StepBatch
from kvcanary.hashing import EMPTY_LINK, LINK_ANCHOR, link_step, to_signed64, to_unsigned64
from kvcanary.layout import CanaryGroup, RecordStore
from kvcanary.schema import NOT_STORED, REASONS, ROW_WIDTH, UNKNOWN_TOKEN, Counter, Field, Phase, Reason
from kvcanary.workspace import PlanWorkspace, ViolationLog

Rewrites = dict[int, list[tuple[int, int, int]]]  # slot -> every (token, position, link) stamped into it

ROW_ACTIVE, ROW_PADDING, ROW_BAD = PlanWorkspace.ROW_ACTIVE, PlanWorkspace.ROW_PADDING, PlanWorkspace.ROW_BAD


def _i32(v: int) -> int:
    """The int32 a value becomes when stored in an int32 tensor (two's complement wrap)."""
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >> 31 else v


def _i64(v: int) -> int:
    return to_signed64(v)


def _list(t: torch.Tensor) -> list[int]:
    return [int(x) for x in t.tolist()]


@dataclasses.dataclass
class _Batch:
    rows: list[int]
    prefix: list[int]
    extend: list[int]
    table: list[list[int]]
    table_width: int  # columns
    input_ids: list[int]
    positions: list[int]
    out_loc: list[int]
    truth: list[list[int]] | None
    truth_width: int
    truth_lens: list[int] | None
    lookup: list[int] | None

    @classmethod
    def read(cls, b: StepBatch) -> _Batch:
        truth = None if b.truth is None else [[int(x) for x in row] for row in b.truth.tolist()]
        return cls(
            rows=_list(b.rows),
            prefix=_list(b.prefix_lens),
            extend=_list(b.extend_lens),
            table=[[int(x) for x in row] for row in b.table.tolist()],
            table_width=int(b.table.shape[1]),
            input_ids=_list(b.input_ids),
            positions=_list(b.positions),
            out_loc=_list(b.out_cache_loc),
            truth=truth,
            truth_width=0 if b.truth is None else int(b.truth.shape[1]),
            truth_lens=None if b.truth_lens is None else _list(b.truth_lens),
            lookup=None if b.lookup is None else _list(b.lookup),
        )


class _Log:
    """The violation log as lists; appends one row at a time, as the docstring of ViolationLog says."""

    def __init__(self, log: ViolationLog) -> None:
        self.first = [[int(x) for x in row] for row in log.first.tolist()]
        self.last = [[int(x) for x in row] for row in log.last.tolist()]
        self.counters = _list(log.counters)
        self.k = len(self.first)

    def append(self, row: list[int]) -> None:
        i = self.counters[Counter.VIOLATIONS]  # lifetime index of this row
        if i < self.k:
            self.first[i] = list(row)
        self.last[i % self.k] = list(row)
        self.counters[Counter.VIOLATIONS] += 1
        for bit, reason in enumerate(REASONS):
            if row[Field.REASONS] & reason:
                self.counters[bit] += 1

    def write_back(self, log: ViolationLog) -> None:
        log.first.copy_(torch.tensor(self.first, dtype=torch.int64).reshape(log.first.shape))
        log.last.copy_(torch.tensor(self.last, dtype=torch.int64).reshape(log.last.shape))
        log.counters.copy_(torch.tensor(self.counters, dtype=torch.int64))


def _row(phase: Phase, group: CanaryGroup, **fields: int) -> list[int]:
    row = [0] * ROW_WIDTH
    row[Field.PHASE] = int(phase)
    row[Field.GROUP] = group.group_id
    row[Field.EXPECTED_TOKEN] = UNKNOWN_TOKEN
    for name, value in fields.items():
        row[Field[name]] = int(value)
    return row


# --------------------------------------------------------------------------- index resolution


def _table_index(group: CanaryGroup, b: _Batch, row: int, pos: int) -> int:
    """The table's entry for position ``pos`` of table row ``row`` (both in range), in int64."""
    page = group.page_size
    entry = b.table[row][pos // page]
    return _i64(entry * page + pos % page)


def _to_pool(b: _Batch, index: int) -> tuple[int, bool]:
    """Translate a table-space index through the lookup; returns (slot, lookup index out of range)."""
    if b.lookup is None:
        return index, False
    if not 0 <= index < len(b.lookup):
        return -1, True
    return b.lookup[index], False


def _expected_token(group: CanaryGroup, b: _Batch, batch_row: int, pos: int) -> int:
    """Ground truth for KV position ``pos`` (a draft pool holds the token of ``pos + token_offset``)."""
    if b.truth is None or b.truth_lens is None:
        return UNKNOWN_TOKEN
    table_row = b.rows[batch_row]
    idx = pos + group.token_offset
    if not (0 <= idx < b.truth_lens[batch_row] and idx < b.truth_width and 0 <= table_row < len(b.truth)):
        return UNKNOWN_TOKEN
    return _i32(b.truth[table_row][idx])  # tokens are int32 wherever they are stored


# --------------------------------------------------------------------------- plan


def plan(group: CanaryGroup, batch: StepBatch, records: RecordStore, ws: PlanWorkspace, log: ViolationLog) -> None:
    b = _Batch.read(batch)
    links = _list(records.links)
    out = _Log(log)
    bs = len(b.rows)
    n_rows = len(b.table)
    width = b.table_width * group.page_size
    n_tokens = len(b.input_ids)
    reserved = set(group.reserved_slots)

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

        seed = LINK_ANCHOR
        reasons = 0
        bad_index = -1
        if row_bad:
            reasons |= Reason.ROW_OUT_OF_RANGE
            bad_index = row
        if len_bad:
            reasons |= Reason.LENGTH_OUT_OF_RANGE
        if active and ext > 0 and pre > 0:
            # The chain continues from the stored link of the last cached position.
            full = _table_index(group, b, row, pre - 1)
            slot, lookup_bad = _to_pool(b, full)
            if lookup_bad:
                reasons |= Reason.LOOKUP_OUT_OF_RANGE
                bad_index = full
            elif not 0 <= slot < records.num_slots:
                reasons |= Reason.SEED_OUT_OF_RANGE
                bad_index = slot
            elif slot not in reserved and links[slot] != EMPTY_LINK:
                seed = to_unsigned64(links[slot])

        starts.append(start)
        seeds.append(seed)
        states.append(ROW_PADDING if padding else ROW_ACTIVE if active else ROW_BAD)
        if reasons:
            out.append(
                _row(
                    Phase.PLAN,
                    group,
                    REASONS=reasons,
                    BATCH_ROW=r,
                    TABLE_ROW=row,
                    SLOT=-1,
                    PRED=-1,
                    EXPECTED_POSITION=pre,
                    STORED_POSITION=pre + ext,
                    BAD_INDEX=bad_index,
                )
            )
    out.counters[Counter.CALLS] += 1

    ws.verify_offsets[: bs + 1] = torch.tensor(verify_offsets, dtype=torch.int64)
    ws.write_offsets[: bs + 1] = torch.tensor(write_offsets, dtype=torch.int64)
    ws.window_starts[:bs] = torch.tensor(starts, dtype=torch.int64)
    ws.seed_links[:bs] = torch.tensor([to_signed64(s) for s in seeds], dtype=torch.int64)
    ws.row_state[:bs] = torch.tensor(states, dtype=torch.int32)
    ws.epoch[0] = int(ws.epoch[0]) + 1  # a new step
    out.write_back(log)


def _mark(ws: PlanWorkspace) -> int:
    """This step's mark: 1 + epoch mod the period (never 0, the value of a fresh mark)."""
    return 1 + int(ws.epoch[0]) % PlanWorkspace.MARK_PERIOD


def _mark_writes(group: CanaryGroup, b: _Batch, ws: PlanWorkspace, n_slots: int) -> None:
    """Every slot a token of an active row stores into: 2 * mark, + 1 when two or more tokens do."""
    offsets = _list(ws.write_offsets[: len(b.rows) + 1])
    states = _list(ws.row_state[: len(b.rows)])
    writers: dict[int, int] = {}
    for r in range(len(b.rows)):
        if states[r] != ROW_ACTIVE:
            continue
        for t in range(offsets[r], min(offsets[r + 1], len(b.input_ids))):
            if b.out_loc[t] == NOT_STORED:
                continue
            slot, lookup_bad = _to_pool(b, b.out_loc[t])
            if not lookup_bad and 0 <= slot < n_slots and slot not in group.reserved_slots:
                writers[slot] = writers.get(slot, 0) + 1
    for slot, n in writers.items():
        ws.write_marks[slot] = 2 * _mark(ws) + (1 if n > 1 else 0)


# --------------------------------------------------------------------------- verify


def verify(
    group: CanaryGroup,
    batch: StepBatch,
    records: RecordStore,
    ws: PlanWorkspace,
    log: ViolationLog,
    capacity: int,
) -> None:
    b = _Batch.read(batch)
    bs = len(b.rows)
    tokens, positions, links = _list(records.tokens), _list(records.positions), _list(records.links)
    n_slots = len(links)
    reserved = set(group.reserved_slots)
    offsets = _list(ws.verify_offsets[: bs + 1])
    starts = _list(ws.window_starts[:bs])
    out = _Log(log)

    def in_pool(s: int) -> bool:
        return 0 <= s < n_slots

    checked_entries = 0
    read_live: dict[int, int] = {}
    for r in range(bs):
        row = b.rows[r]
        for k in range(offsets[r + 1] - offsets[r]):
            if checked_entries == capacity:
                break
            checked_entries += 1
            pos = starts[r] + k
            full = _table_index(group, b, row, pos)
            slot, lookup_bad = _to_pool(b, full)
            readable = not lookup_bad and in_pool(slot)
            s_tok, s_pos, s_link = (tokens[slot], positions[slot], links[slot]) if readable else (0, 0, 0)
            is_reserved = readable and slot in reserved
            never = readable and not is_reserved and s_link == EMPTY_LINK
            if readable and not is_reserved:
                read_live.setdefault(slot, r)  # attention gathers it this step (rows come in order)
            checked = readable and not is_reserved and not never
            exp_tok = _expected_token(group, b, r, pos)

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

            # The link is recomputed from the predecessor's stored link and this record's own fields.
            pred = -1
            prev_link: int | None = LINK_ANCHOR
            if pos > 0:
                pfull = _table_index(group, b, row, pos - 1)
                pslot, plookup_bad = _to_pool(b, pfull)
                prev_link = None
                if plookup_bad:
                    if checked:
                        reasons |= Reason.LOOKUP_OUT_OF_RANGE
                        if bad_index == -1:
                            bad_index = pfull
                else:
                    pred = pslot
                    if not in_pool(pslot):
                        if checked:
                            reasons |= Reason.PREDECESSOR_OUT_OF_RANGE
                            if bad_index == -1:
                                bad_index = pslot
                    elif pslot not in reserved:
                        prev_link = links[pslot]
            exp_link = 0
            if checked and prev_link is not None:
                exp_link = to_signed64(link_step(prev_link, s_tok, s_pos))
                if exp_link != s_link:
                    reasons |= Reason.LINK_MISMATCH

            if reasons:
                out.append(
                    _row(
                        Phase.VERIFY,
                        group,
                        REASONS=reasons,
                        BATCH_ROW=r,
                        TABLE_ROW=row,
                        SLOT=slot,
                        PRED=pred,
                        EXPECTED_POSITION=pos,
                        STORED_POSITION=s_pos,
                        EXPECTED_TOKEN=exp_tok,
                        STORED_TOKEN=s_tok,
                        EXPECTED_LINK=exp_link,
                        STORED_LINK=s_link,
                        BAD_INDEX=bad_index,
                    )
                )
    epoch = int(ws.epoch[0])
    for slot, row in read_live.items():  # the lowest batch row that read it; kept over older steps' marks
        ws.read_marks[slot] = max(int(ws.read_marks[slot]), PlanWorkspace.read_mark(epoch, row))
    _mark_writes(group, b, ws, n_slots)
    out.counters[Counter.VERIFIED] += checked_entries
    out.counters[Counter.SKIPPED] += offsets[bs] - checked_entries
    out.counters[Counter.CALLS] += 1
    out.write_back(log)


# --------------------------------------------------------------------------- stamp


def stamp(group: CanaryGroup, batch: StepBatch, records: RecordStore, ws: PlanWorkspace, log: ViolationLog) -> Rewrites:
    """Stamp the step's tokens one at a time.

    Returns the slots written more than once, each with every (token, position, link) written to it:
    which of them the slot ends up holding is unspecified.
    """
    b = _Batch.read(batch)
    bs = len(b.rows)
    tokens, positions, links = _list(records.tokens), _list(records.positions), _list(records.links)
    n_slots = len(links)
    reserved = set(group.reserved_slots)
    offsets = _list(ws.write_offsets[: bs + 1])
    seeds = _list(ws.seed_links[:bs])
    states = _list(ws.row_state[:bs])
    out = _Log(log)
    written: Rewrites = {}
    marks = (int(ws.epoch[0]), _list(ws.read_marks), _list(ws.write_marks), list(positions))  # as verify saw them

    for r in range(bs):
        if states[r] != ROW_ACTIVE:
            continue
        link = to_unsigned64(seeds[r])
        for i in range(offsets[r + 1] - offsets[r]):
            t = offsets[r] + i
            if t >= len(b.input_ids):
                break
            tok, pos = _i32(b.input_ids[t]), b.positions[t]
            link = link_step(link, tok, _i32(pos))  # chained even when the token is not stored
            exp_pos = b.prefix[r] + i
            exp_tok = _expected_token(group, b, r, exp_pos)
            full = b.out_loc[t]

            reasons = 0
            slot, bad_index, named = -1, -1, r
            if full != NOT_STORED:
                slot, lookup_bad = _to_pool(b, full)
                if lookup_bad:
                    reasons |= Reason.LOOKUP_OUT_OF_RANGE
                    bad_index = full
                elif not 0 <= slot < n_slots:
                    reasons |= Reason.SLOT_OUT_OF_RANGE
                    bad_index = slot
                elif slot in reserved:
                    reasons |= Reason.RESERVED_SLOT
                else:
                    tokens[slot], positions[slot], links[slot] = tok, _i32(pos), to_signed64(link)
                    written.setdefault(slot, []).append((tok, _i32(pos), to_signed64(link)))
                    same, bad_index, named = _same_step(group, b, marks, r, exp_pos, slot)
                    reasons |= same
            if pos != exp_pos:
                reasons |= Reason.WRITE_POSITION_MISMATCH
            if exp_tok != UNKNOWN_TOKEN and tok != exp_tok:
                reasons |= Reason.WRITE_TOKEN_MISMATCH
            if reasons:
                out.append(
                    _row(
                        Phase.STAMP,
                        group,
                        REASONS=reasons,
                        BATCH_ROW=named,
                        TABLE_ROW=b.rows[named],
                        SLOT=slot,
                        PRED=-1,
                        EXPECTED_POSITION=exp_pos,
                        STORED_POSITION=pos,
                        EXPECTED_TOKEN=exp_tok,
                        STORED_TOKEN=tok,
                        STORED_LINK=to_signed64(link),
                        BAD_INDEX=bad_index,
                    )
                )
    out.counters[Counter.STAMPED] += sum(len(w) for w in written.values())
    out.counters[Counter.CALLS] += 1
    out.write_back(log)
    records.tokens.copy_(torch.tensor(tokens, dtype=torch.int32))
    records.positions.copy_(torch.tensor(positions, dtype=torch.int32))
    records.links.copy_(torch.tensor(links, dtype=torch.int64))
    return {s: w for s, w in written.items() if len(w) > 1}


def _same_step(
    group: CanaryGroup, b: _Batch, marks: tuple[int, list[int], list[int], list[int]], r: int, pos: int, slot: int
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
            own, own_bad = _to_pool(b, _table_index(group, b, row, q))
            ring = not own_bad and own == slot
        if not ring:
            reasons |= Reason.WRITE_INTO_LIVE_SLOT
            live = True
            named = limit - 1 - (read_marks[slot] & (limit - 1))
    if write_marks[slot] == 2 * mark + 1:
        reasons |= Reason.DUPLICATE_WRITE
    if group.checks_new_reads:
        entry = _table_index(group, b, row, pos)
        read, read_bad = _to_pool(b, entry)
        exempt = not read_bad and 0 <= read < n_slots and read in group.reserved_slots
        if not exempt and (read_bad or read != slot):
            reasons |= Reason.NEW_READ_MISMATCH
            bad_index = entry
    if live:
        bad_index = r
    return reasons, bad_index, named


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
