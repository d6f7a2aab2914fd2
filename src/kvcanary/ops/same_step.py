"""Same-step write checks of the reference: marks that verify leaves and stamp tests.

Verify keeps ``PlanWorkspace.read_mark(epoch, batch row)`` (the epoch bumped by plan; the largest value,
so the lowest reading batch row) on every slot it reads live (a verify entry in the pool and not
reserved: a slot attention gathers this step), and on every slot that a token of an active row writes
``2 * mark`` (``mark = 1 + epoch % MARK_PERIOD``), plus 1 when two or more tokens write it.
Stamp then reports, per written token:

- ``WRITE_INTO_LIVE_SLOT``: the slot is read live this step (another request's slot, or the request's own
  earlier position), except a window group's ring reuse: the slot holds a position ``q`` of the writer's
  own verify span that the writing token at ``p`` no longer attends to (``q < p - window``) and the
  writer's table maps ``q`` to this slot.  A decode in a tight ring overwrites ``q = p - window - 1``;
  a chunk longer than the window overwrites older ones too (its earlier tokens attend to them: an
  engine that gathers the past before it writes, as transformers does, reads them intact);
- ``DUPLICATE_WRITE``: another token of the step writes the same slot (every writer is reported);
- ``NEW_READ_MISMATCH`` (groups with ``checks_new_reads``): the table entry at the token's own position
  resolves to another slot than the one it writes.  A reserved entry is exempt: the engine reads that
  token from outside the pool (a sentinel).

The marks make this O(entries + tokens): no search of the read set.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvcanary.batch import StepBatch
from kvcanary.layout import CanaryGroup
from kvcanary.ops.resolution import Resolved, resolve, table_slots
from kvcanary.schema import NOT_STORED, Reason
from kvcanary.workspace import PlanWorkspace


class WriteTokens(NamedTuple):
    """The tokens of the active rows, in flat order, with the slot each writes."""

    t: torch.Tensor  # flat token index
    r: torch.Tensor  # batch row
    i: torch.Tensor  # index within the row's written tokens
    full: torch.Tensor  # out_cache_loc (table index space)
    stored: torch.Tensor  # out_cache_loc != NOT_STORED
    res: Resolved
    writable: torch.Tensor  # in the pool and not reserved: the record is written


def write_tokens(group: CanaryGroup, batch: StepBatch, ws: PlanWorkspace, num_slots: int) -> WriteTokens:
    b = batch.batch_size
    woff = ws.write_offsets[: b + 1]
    n_tok = min(int(woff[b]), batch.num_tokens)
    t = torch.arange(n_tok, dtype=torch.int64, device=batch.rows.device)
    r = torch.searchsorted(woff[1:], t, right=True)
    live = ws.row_state[r] == PlanWorkspace.ROW_ACTIVE
    t, r = t[live], r[live]
    full = batch.out_cache_loc[t].long()
    res = resolve(group, batch.lookup, full, num_slots)
    return WriteTokens(t, r, t - woff[r], full, full != NOT_STORED, res, res.in_pool & ~res.reserved)


def current_mark(ws: PlanWorkspace) -> torch.Tensor:
    return 1 + ws.epoch[0] % PlanWorkspace.MARK_PERIOD


def mark_step(
    group: CanaryGroup,
    batch: StepBatch,
    ws: PlanWorkspace,
    read_slots: torch.Tensor,
    read_rows: torch.Tensor,
    num_slots: int,
) -> None:
    """Verify's part: mark the slots read live (``read_slots``, by batch rows ``read_rows``) and the slots
    written this step."""
    mark = current_mark(ws)
    values = (ws.epoch[0] << PlanWorkspace.READER_BITS) | (PlanWorkspace.READER_LIMIT - 1 - read_rows)
    ws.read_marks.scatter_reduce_(0, read_slots, values, reduce="amax")  # the lowest reader row wins
    w = write_tokens(group, batch, ws, num_slots)
    dst = w.res.slot[w.writable]
    twice = torch.bincount(dst, minlength=num_slots)[dst] > 1
    ws.write_marks[dst] = (2 * mark + twice.long()).to(torch.int32)


def write_reasons(
    group: CanaryGroup,
    batch: StepBatch,
    ws: PlanWorkspace,
    w: WriteTokens,
    old_positions: torch.Tensor,
    num_slots: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stamp's part, before any record is written (``old_positions``: the records' positions as verify saw
    them): per written token, its same-step reasons, its BAD_INDEX (a live write: the writing batch row; a
    NEW_READ_MISMATCH: the table entry of its own position; else -1) and the batch row its log row names
    (a live write: the lowest batch row that reads the slot this step; else the writer's)."""
    mark = current_mark(ws)
    slot = w.res.slot
    sc = slot.clamp(0, num_slots - 1)
    trow = batch.rows.long()[w.r]
    pre = batch.prefix_lens.long()[w.r]
    pos = pre + w.i
    width = batch.table.shape[1] * group.page_size
    rmark = ws.read_marks[sc]
    live = w.writable & ((rmark >> PlanWorkspace.READER_BITS) == ws.epoch[0])
    reader = PlanWorkspace.READER_LIMIT - 1 - (rmark & (PlanWorkspace.READER_LIMIT - 1))
    if group.window > 0 and width > 0:
        # The slot's record as verify saw it: a position of the writer's own window that this token no
        # longer attends to, and that the writer's own table maps here, is the ring's reuse.
        q = old_positions[sc].long()
        in_span = (q >= (pre - group.window).clamp(min=0)) & (q < pre) & (q < pos - group.window)
        own = resolve(group, batch.lookup, table_slots(group, batch.table, trow, q.clamp(0, width - 1)), num_slots)
        live &= ~(in_span & own.in_pool & (own.slot == slot))
    dup = w.writable & (ws.write_marks[sc].long() == 2 * mark + 1)
    reasons = live.long() * Reason.WRITE_INTO_LIVE_SLOT | dup.long() * Reason.DUPLICATE_WRITE
    bad_index = torch.full_like(slot, -1)
    if group.checks_new_reads and width > 0:
        nfull = table_slots(group, batch.table, trow, pos.clamp(0, width - 1))
        new = resolve(group, batch.lookup, nfull, num_slots)
        new_bad = w.writable & ~new.reserved & (new.slot != slot)
        reasons = reasons | new_bad.long() * Reason.NEW_READ_MISMATCH
        bad_index = torch.where(new_bad, nfull, bad_index)
    # A live write's row names the request whose read it hits (the one to fail); BAD_INDEX the writer.
    return reasons, torch.where(live, w.r, bad_index), torch.where(live, reader, w.r)
