"""PyTorch reference of plan, verify and stamp: the executable spec the kernels match byte for byte.

Vectorised over requests and tokens (no Python loop over either); runs on any device.  It handles
every input value, corrupt ones included: an index outside its table or pool becomes a violation
with its own reason, never an out-of-bounds access.  Host-side validation of the batch happens
before these functions are called (:mod:`kvcanary.batch`); they assume only well-formed metadata.
"""

from __future__ import annotations

import torch

from kvcanary import hashing
from kvcanary.batch import StepBatch
from kvcanary.layout import CanaryGroup, RecordStore
from kvcanary.ops import same_step
from kvcanary.ops.resolution import (  # noqa: F401  (re-exported: the reference's index helpers)
    Resolved,
    expected_tokens,
    in_pool,
    is_reserved,
    resolve,
    table_slots,
    through_lookup,
)
from kvcanary.schema import NUM_REASONS, ROW_WIDTH, UNKNOWN_TOKEN, Counter, Field, Phase, Reason
from kvcanary.workspace import GroupState, PlanWorkspace, ViolationLog

_ANCHOR = hashing.to_signed64(hashing.LINK_ANCHOR)
# extend_lens saturate here before their row sums: no real step writes 2**32 tokens, and a corrupt int64
# length must not wrap the sums (a wrapped sum would make a bad row look active).
MAX_EXTEND = 1 << 32


# --------------------------------------------------------------------------- the log


def _new_rows(n: int, phase: Phase, group: CanaryGroup, device: torch.device) -> torch.Tensor:
    rows = torch.zeros(n, ROW_WIDTH, dtype=torch.int64, device=device)
    rows[:, Field.PHASE] = int(phase)
    rows[:, Field.GROUP] = group.group_id
    rows[:, Field.EXPECTED_TOKEN] = UNKNOWN_TOKEN
    return rows


def append_rows(log: ViolationLog, rows: torch.Tensor) -> None:
    """Append rows (already in log order) to the log and count their reasons."""
    m = int(rows.shape[0])
    if m == 0:
        return
    k = log.capacity
    n0 = int(log.counters[Counter.VIOLATIONS])
    g = n0 + torch.arange(m, device=rows.device)
    head = g < k
    log.first[g[head]] = rows[head]
    tail = g >= n0 + m - k
    log.last[g[tail] % k] = rows[tail]
    log.counters[Counter.VIOLATIONS] += m
    bits = (rows[:, Field.REASONS].unsqueeze(1) >> torch.arange(NUM_REASONS, device=rows.device)) & 1
    log.counters[:NUM_REASONS] += bits.sum(0)


def _slot_reasons(lookup_bad: torch.Tensor, slot_oor: torch.Tensor, reserved: torch.Tensor) -> torch.Tensor:
    """The reasons a slot's resolution can raise: its lookup or the slot out of range, or a reserved slot."""
    return (
        lookup_bad.long() * Reason.LOOKUP_OUT_OF_RANGE
        | slot_oor.long() * Reason.SLOT_OUT_OF_RANGE
        | reserved.long() * Reason.RESERVED_SLOT
    )


def _log_hits(
    log: ViolationLog, phase: Phase, group: CanaryGroup, reasons: torch.Tensor, fields: dict[Field, torch.Tensor | int]
) -> None:
    """Log one row per entry whose ``reasons`` are not empty; ``fields``: a value per entry, or one for all."""
    hit = (reasons != 0).nonzero().flatten()
    out = _new_rows(int(hit.shape[0]), phase, group, reasons.device)
    out[:, Field.REASONS] = reasons[hit]
    for field, values in fields.items():
        out[:, field] = values if isinstance(values, int) else values[hit]
    append_rows(log, out)


# --------------------------------------------------------------------------- plan


def plan(state: GroupState, batch: StepBatch) -> None:
    """Per batch row: classify it, size its verify span and write range, and resolve its chain seed.

    ``write_offsets`` is the exclusive prefix sum of ``extend_lens`` clamped to ``[0, MAX_EXTEND]`` (padding
    and bad rows included: their tokens still occupy the flat token arrays).  A row is LENGTH_OUT_OF_RANGE
    when a length is negative, ``prefix_len + extend_len`` exceeds the table width, or its write range
    ends past ``num_tokens``; both tests are exact for any int64 value (no wrap).
    """
    group, records, ws, log = state
    b = batch.batch_size
    dev = batch.rows.device
    rows = batch.rows.long()
    pre = batch.prefix_lens.long()
    ext = batch.extend_lens.long()
    pad, row_bad, len_bad, write_offsets = _classify_rows(group, batch)
    active = ~(pad | row_bad | len_bad)

    starts = (pre - group.window).clamp(min=0) if group.window > 0 else torch.zeros_like(pre)
    starts = torch.where(active, starts, 0)
    counts = torch.where(active, pre - starts, 0)
    verify_offsets = torch.zeros(b + 1, dtype=torch.int64, device=dev)
    verify_offsets[1:] = torch.cumsum(counts, 0)

    seed_links, sfull, sslot, slookup_bad, seed_oor = _seed_links(group, batch, records, active)

    ws.write_offsets[: b + 1] = write_offsets
    ws.verify_offsets[: b + 1] = verify_offsets
    ws.window_starts[:b] = starts
    ws.seed_links[:b] = seed_links
    row_state = torch.where(
        pad, PlanWorkspace.ROW_PADDING, torch.where(active, PlanWorkspace.ROW_ACTIVE, PlanWorkspace.ROW_BAD)
    )
    ws.row_state[:b] = row_state.to(torch.int32)
    ws.epoch += 1  # a new step: the same-step marks of earlier steps go stale

    reasons = (
        row_bad.long() * Reason.ROW_OUT_OF_RANGE
        | len_bad.long() * Reason.LENGTH_OUT_OF_RANGE
        | slookup_bad.long() * Reason.LOOKUP_OUT_OF_RANGE
        | seed_oor.long() * Reason.SEED_OUT_OF_RANGE
    )
    bad_index = torch.where(row_bad, rows, torch.where(slookup_bad, sfull, torch.where(seed_oor, sslot, -1)))
    _log_hits(log, Phase.PLAN, group, reasons, {
        Field.BATCH_ROW: torch.arange(b, device=dev), Field.TABLE_ROW: rows, Field.SLOT: -1, Field.PRED: -1,
        Field.EXPECTED_POSITION: pre, Field.STORED_POSITION: pre + ext, Field.BAD_INDEX: bad_index,
    })  # fmt: skip
    log.counters[Counter.CALLS] += 1


def _classify_rows(
    group: CanaryGroup, batch: StepBatch
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: padding, table row out of range, lengths out of range; and the rows' ``write_offsets``."""
    rows = batch.rows.long()
    pre = batch.prefix_lens.long()
    ext = batch.extend_lens.long()
    n_rows = batch.table.shape[0]
    width = batch.table.shape[1] * group.page_size
    pad = rows == group.padding_row if group.padding_row is not None else torch.zeros_like(rows, dtype=torch.bool)
    row_bad = ~pad & ((rows < 0) | (rows >= n_rows))
    write_offsets = torch.zeros(batch.batch_size + 1, dtype=torch.int64, device=batch.rows.device)
    write_offsets[1:] = torch.cumsum(ext.clamp(0, MAX_EXTEND), 0)
    # pre > width - ext, not pre + ext > width: exact for non-negative lengths, no int64 wrap.
    too_long = pre > width - ext
    len_bad = ~pad & ~row_bad & ((pre < 0) | (ext < 0) | too_long | (write_offsets[1:] > batch.num_tokens))
    return pad, row_bad, len_bad, write_offsets


def _seed_links(
    group: CanaryGroup, batch: StepBatch, records: RecordStore, active: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: the stored link of the slot at prefix_len - 1; the anchor when there is none to trust.

    Returns the seeds, that slot's table entry and resolved slot, and its lookup / slot out-of-range flags.
    """
    rows = batch.rows.long()
    pre = batch.prefix_lens.long()
    n_rows = batch.table.shape[0]
    width = batch.table.shape[1] * group.page_size
    need_seed = active & (batch.extend_lens.long() > 0) & (pre > 0)
    srow = rows.clamp(0, max(n_rows - 1, 0))
    spos = (pre - 1).clamp(0, max(width - 1, 0))
    if width > 0 and n_rows > 0:
        sfull = table_slots(group, batch.table, srow, spos)
    else:
        sfull = torch.zeros_like(rows)
    sslot, slookup_bad, seed_oor, sin_pool, sreserved = resolve(group, batch.lookup, sfull, records.num_slots)
    slookup_bad &= need_seed
    seed_oor &= need_seed
    slink = records.links[sslot.clamp(0, records.num_slots - 1)]
    trusted = need_seed & sin_pool & ~sreserved & (slink != hashing.EMPTY_LINK)
    return torch.where(trusted, slink, _ANCHOR), sfull, sslot, slookup_bad, seed_oor


# --------------------------------------------------------------------------- verify


def verify(state: GroupState, batch: StepBatch, capacity: int) -> None:
    """Check every planned entry (up to ``capacity``; the rest are counted as skipped)."""
    group, records, ws, log = state
    n_slots = records.num_slots
    total, n, r, pos = _planned_entries(batch, ws, capacity)
    trow = batch.rows.long()[r]

    full = table_slots(group, batch.table, trow, pos)
    slot, lookup_bad, slot_oor, ok, reserved = resolve(group, batch.lookup, full, n_slots)
    sc = slot.clamp(0, n_slots - 1)
    tok32 = records.tokens[sc]
    pos32 = records.positions[sc]
    stored_tok = torch.where(ok, tok32.long(), 0)
    stored_pos = torch.where(ok, pos32.long(), 0)
    stored_link = torch.where(ok, records.links[sc], 0)
    never = ok & ~reserved & (stored_link == hashing.EMPTY_LINK)
    checked = ok & ~reserved & ~never

    exp_tok = expected_tokens(group, batch, r, pos)
    pos_bad = checked & (stored_pos != pos)
    tok_bad = checked & (exp_tok != UNKNOWN_TOKEN) & (stored_tok != exp_tok)

    pred = _predecessors(group, batch, records, trow, pos, checked)
    pfull, pslot, pred_resolved, plookup_bad, pred_oor, prev_link, link_checked = pred
    exp_link = torch.where(link_checked, hashing.link_step_t(prev_link, tok32, pos32), 0)
    link_bad = link_checked & (exp_link != stored_link)
    same_step.mark_step(group, batch, ws, slot[ok & ~reserved], r[ok & ~reserved], n_slots)

    reasons = (
        _slot_reasons(lookup_bad, slot_oor, reserved)
        | never.long() * Reason.NEVER_WRITTEN
        | pos_bad.long() * Reason.POSITION_MISMATCH
        | tok_bad.long() * Reason.TOKEN_MISMATCH
        | link_bad.long() * Reason.LINK_MISMATCH
        | plookup_bad.long() * Reason.LOOKUP_OUT_OF_RANGE
        | pred_oor.long() * Reason.PREDECESSOR_OUT_OF_RANGE
    )
    bad_index = torch.where(
        lookup_bad,
        full,
        torch.where(slot_oor, slot, torch.where(plookup_bad, pfull, torch.where(pred_oor, pslot, -1))),
    )
    _log_hits(log, Phase.VERIFY, group, reasons, {
        Field.BATCH_ROW: r, Field.TABLE_ROW: trow, Field.SLOT: slot, Field.PRED: torch.where(pred_resolved, pslot, -1),
        Field.EXPECTED_POSITION: pos, Field.STORED_POSITION: stored_pos,
        Field.EXPECTED_TOKEN: exp_tok, Field.STORED_TOKEN: stored_tok,
        Field.EXPECTED_LINK: exp_link, Field.STORED_LINK: stored_link, Field.BAD_INDEX: bad_index,
    })  # fmt: skip
    log.counters[Counter.VERIFIED] += n
    log.counters[Counter.SKIPPED] += total - n
    log.counters[Counter.CALLS] += 1


def _planned_entries(batch: StepBatch, ws: PlanWorkspace, capacity: int) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """How many entries plan asked to verify, how many fit ``capacity``, and the batch row and position of each."""
    b = batch.batch_size
    voff = ws.verify_offsets[: b + 1]
    total = int(voff[b])
    n = min(total, capacity)
    e = torch.arange(n, dtype=torch.int64, device=batch.rows.device)
    r = torch.searchsorted(voff[1:], e, right=True)
    return total, n, r, ws.window_starts[r] + e - voff[r]


def _predecessors(
    group: CanaryGroup,
    batch: StepBatch,
    records: RecordStore,
    trow: torch.Tensor,
    pos: torch.Tensor,
    checked: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """Per verified entry, its predecessor (position - 1): table entry, slot, whether it resolved, its lookup /
    slot out-of-range flags, the link to chain from (the anchor at position 0) and whether the link is checked."""
    n_slots = records.num_slots
    has_pred = pos > 0
    pfull = table_slots(group, batch.table, trow, (pos - 1).clamp(min=0))
    pslot, plookup_raw = through_lookup(batch.lookup, pfull)
    pred_resolved = has_pred & ~plookup_raw
    plookup_bad = checked & has_pred & plookup_raw
    pred_oor = checked & pred_resolved & ~in_pool(pslot, n_slots)
    pred_usable = pred_resolved & in_pool(pslot, n_slots) & ~is_reserved(group, pslot)
    prev_link = torch.where(has_pred, records.links[pslot.clamp(0, n_slots - 1)], _ANCHOR)
    link_checked = checked & (~has_pred | pred_usable)
    return pfull, pslot, pred_resolved, plookup_bad, pred_oor, prev_link, link_checked


# --------------------------------------------------------------------------- stamp


def stamp(state: GroupState, batch: StepBatch) -> None:
    """Write (token, position, link) for every token of an active row, chaining from the row's seed.

    Links follow the tokens actually written (so one bad input does not cascade).  A token whose
    ``out_cache_loc`` is ``NOT_STORED`` (-1, e.g. vLLM's padding slot id, a window's trash write) is
    not stored and raises no slot violation, but still advances its row's chain and is still checked
    for position and token.  The same-step checks (:mod:`.same_step`) use the marks verify left: a write
    into a slot read live this step, a slot written twice (every writer reported; which record survives
    is unspecified) and a new token's table entry that resolves elsewhere.
    """
    group, records, ws, log = state
    n_slots = records.num_slots
    wt = same_step.write_tokens(group, batch, ws, n_slots)
    t, r, i = wt.t, wt.r, wt.i
    exp_pos = batch.prefix_lens.long()[r] + i
    tok32 = batch.input_ids[t].to(torch.int32)
    pos64 = batch.positions[t].long()
    pos32 = batch.positions[t].to(torch.int32)

    links = _chain_links(ws, wt, tok32, pos32)

    full, writable = wt.full, wt.writable
    slot, lookup_bad, slot_oor, _ok, reserved = wt.res
    # A NOT_STORED token resolves to nothing and is no violation: it is simply not kept.
    lookup_bad = lookup_bad & wt.stored
    slot_oor = slot_oor & wt.stored
    same, same_index, named_row = same_step.write_reasons(group, batch, ws, wt, records.positions, n_slots)
    exp_tok = expected_tokens(group, batch, r, exp_pos)
    wpos_bad = pos64 != exp_pos
    wtok_bad = (exp_tok != UNKNOWN_TOKEN) & (tok32.long() != exp_tok)

    dst = slot[writable]
    records.tokens[dst] = tok32[writable]
    records.positions[dst] = pos32[writable]
    records.links[dst] = links[writable]

    reasons = (
        _slot_reasons(lookup_bad, slot_oor, reserved)
        | wpos_bad.long() * Reason.WRITE_POSITION_MISMATCH
        | wtok_bad.long() * Reason.WRITE_TOKEN_MISMATCH
        | same
    )
    bad_index = torch.where(lookup_bad, full, torch.where(slot_oor, slot, same_index))
    _log_hits(log, Phase.STAMP, group, reasons, {
        Field.BATCH_ROW: named_row, Field.TABLE_ROW: batch.rows.long()[named_row], Field.SLOT: slot, Field.PRED: -1,
        Field.EXPECTED_POSITION: exp_pos, Field.STORED_POSITION: pos64,
        Field.EXPECTED_TOKEN: exp_tok, Field.STORED_TOKEN: tok32.long(),
        Field.STORED_LINK: links, Field.BAD_INDEX: bad_index,
    })  # fmt: skip
    log.counters[Counter.STAMPED] += int(writable.sum())
    log.counters[Counter.CALLS] += 1


def _chain_links(
    ws: PlanWorkspace, wt: same_step.WriteTokens, tok32: torch.Tensor, pos32: torch.Tensor
) -> torch.Tensor:
    """Each written token's link, chained from its row's seed in one pass (no loop over tokens).

    Closed form of the affine scan: link_t = M**(i+1) * seed + M**t * sum_{j=s..t} mix_j * M**-j.
    """
    t, r, i = wt.t, wt.r, wt.i
    w = hashing.mix_t(tok32, pos32) * ws.inv_powers[t]
    csum = torch.cumsum(w, 0)
    k = torch.arange(t.shape[0], device=t.device)
    seg = csum - (csum - w)[k - i] if t.shape[0] else csum
    return ws.mult_powers[i + 1] * ws.seed_links[r] + ws.mult_powers[t] * seg
