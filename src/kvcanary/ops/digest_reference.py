"""PyTorch reference of the KV digest calls: the executable spec the digest kernels match exactly.

* :func:`slot_digests`: the digest (``docs/design.md`` §12, :mod:`kvcanary.digest`) of in-pool slots.
* :func:`stamp_list` / :func:`verify_list`: a list of table indices (a step's ``out_cache_loc``, or slots
  whose bytes were moved); ``-1`` entries are skipped, reserved slots too, and an index outside the
  lookup or the pool is skipped or, with ``report_range``, reported as ``slot_out_of_range``.
* :func:`verify_planned`: a budgeted, rotating share of the entries the last plan verifies: positions
  ``p`` of each active row's verify span with ``(p // group_tokens) % period == epoch % period``, in
  tiles of ``group_tokens`` positions, at most ``entries // group_tokens`` tiles a call (the
  rest are counted as skipped tiles); slots the step also writes (its write marks) are left to the
  stamp; the digest epoch then advances.
* :func:`verify_and_stamp`: :func:`verify_planned` then :func:`stamp_list` of the batch's writes, for an
  engine whose step is verified once its forward has written (the kernel runs both in one launch); the
  stamp's entries come off the verify's share of the workspace.

A stored digest of 0 (never stamped) is never compared.  Violation rows are appended in entry order.
"""

from __future__ import annotations

import torch

from kvcanary import hashing
from kvcanary.batch import StepBatch
from kvcanary.digest import DIGEST_GAMMA, DIGEST_SEED, TILE_TOKENS, WORD_BYTES, DigestLayout, DigestWorkspace
from kvcanary.layout import CanaryGroup
from kvcanary.ops.reference import append_rows
from kvcanary.ops.resolution import resolve, table_slots
from kvcanary.schema import ROW_WIDTH, UNKNOWN_TOKEN, Field, Phase, Reason
from kvcanary.workspace import PlanWorkspace, ViolationLog

_CHUNK = 4096  # slots digested at once: bounds the reference's temporaries


def word_keys(words: int, device: torch.device | str) -> torch.Tensor:
    """``key(i)`` for i in [0, words) as int64 (two's complement)."""
    i = torch.arange(1, words + 1, dtype=torch.int64, device=device)
    return hashing.fmix64_t(i * hashing.to_signed64(DIGEST_GAMMA) + hashing.to_signed64(DIGEST_SEED))


def _component_words(view: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """int64 [n, heads * words_per_head]: each slot's head rows as little-endian words, zero-padded."""
    bs = view.shape[1]
    rows = view[slots // bs, slots % bs]  # [n, heads, dim], a copy in element order
    n, heads, dim = rows.shape
    raw = rows.contiguous().view(torch.uint8).reshape(n, heads, dim * view.element_size())
    pad = -raw.shape[2] % WORD_BYTES
    if pad:
        raw = torch.cat([raw, raw.new_zeros(n, heads, pad)], dim=2)
    return raw.view(torch.int64).reshape(n, -1)


def slot_digests(layout: DigestLayout, slots: torch.Tensor) -> torch.Tensor:
    """Digests (int64, odd) of ``slots``, which must all lie in ``[0, layout.num_slots)``."""
    slots = slots.long().to(layout.device)
    keys = word_keys(layout.words, layout.device)
    out = torch.zeros(slots.shape[0], dtype=torch.int64, device=layout.device)
    for c0 in range(0, int(slots.shape[0]), _CHUNK):
        part = slots[c0 : c0 + _CHUNK]
        total = torch.zeros_like(part)
        for comp, base in zip(layout.components, layout.word_bases(), strict=True):
            words = _component_words(comp.view, part)
            terms = hashing.fmix64_t(words ^ keys[base : base + comp.shape.words])
            total += terms.sum(dim=1)  # int64 sums wrap: arithmetic mod 2**64
        out[c0 : c0 + _CHUNK] = total | 1
    return out


def _rows(n: int, phase: Phase, group: CanaryGroup, device: torch.device) -> torch.Tensor:
    rows = torch.zeros(n, ROW_WIDTH, dtype=torch.int64, device=device)
    rows[:, Field.PHASE] = int(phase)
    rows[:, Field.GROUP] = group.group_id
    for f in (Field.BATCH_ROW, Field.TABLE_ROW, Field.PRED, Field.EXPECTED_POSITION, Field.STORED_POSITION,
              Field.STORED_TOKEN, Field.BAD_INDEX):  # fmt: skip
        rows[:, f] = -1
    rows[:, Field.EXPECTED_TOKEN] = UNKNOWN_TOKEN
    return rows


def _check(
    group: CanaryGroup, layout: DigestLayout, digests: torch.Tensor, slot: torch.Tensor, usable: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(stored, computed, mismatch) for each entry; only usable entries are read."""
    stored = torch.zeros_like(slot)
    computed = torch.zeros_like(slot)
    stored[usable] = digests[slot[usable]]
    computed[usable] = slot_digests(layout, slot[usable])
    return stored, computed, usable & (stored != 0) & (stored != computed)


def _list_call(
    group: CanaryGroup,
    layout: DigestLayout,
    digests: torch.Tensor,
    ws: DigestWorkspace,
    log: ViolationLog,
    locs: torch.Tensor,
    lookup: torch.Tensor | None,
    report_range: bool,
    phase: Phase,
) -> None:
    locs = locs.long()
    stored_entry = locs != -1
    res = resolve(group, lookup, locs, min(group.num_slots, layout.num_slots))
    usable = stored_entry & res.in_pool & ~res.reserved
    bad_range = stored_entry & (res.lookup_bad | res.out_of_pool) & report_range
    if phase is Phase.DIGEST_STAMP:
        digests[res.slot[usable]] = slot_digests(layout, res.slot[usable])
        stored = computed = torch.zeros_like(locs)
        mismatch = torch.zeros_like(usable)
        ws.stats[DigestWorkspace.STAT_STAMPED] += int(usable.sum())
    else:
        stored, computed, mismatch = _check(group, layout, digests, res.slot, usable)
        ws.stats[DigestWorkspace.STAT_VERIFIED] += int(usable.sum())
    ws.stats[DigestWorkspace.STAT_CALLS] += 1
    hit = mismatch | bad_range
    out = _rows(int(hit.sum()), phase, group, locs.device)
    out[:, Field.REASONS] = torch.where(bad_range[hit], int(Reason.SLOT_OUT_OF_RANGE), int(Reason.DIGEST_MISMATCH))
    out[:, Field.SLOT] = torch.where(bad_range[hit], -1, res.slot[hit])
    out[:, Field.BAD_INDEX] = torch.where(bad_range[hit], locs[hit], -1)  # the list's own index value
    out[:, Field.EXPECTED_LINK] = stored[hit]
    out[:, Field.STORED_LINK] = computed[hit]
    append_rows(log, out)


def stamp_list(
    group: CanaryGroup, layout: DigestLayout, digests: torch.Tensor, ws: DigestWorkspace, log: ViolationLog,
    locs: torch.Tensor, *, lookup: torch.Tensor | None = None, report_range: bool = False,
) -> None:  # fmt: skip
    """Stamp the digest of every slot in ``locs`` (table indices; -1 = not stored)."""
    _list_call(group, layout, digests, ws, log, locs, lookup, report_range, Phase.DIGEST_STAMP)


def verify_list(
    group: CanaryGroup, layout: DigestLayout, digests: torch.Tensor, ws: DigestWorkspace, log: ViolationLog,
    locs: torch.Tensor, *, lookup: torch.Tensor | None = None, report_range: bool = False,
) -> None:  # fmt: skip
    """Recompute the digest of every slot in ``locs`` and report those that differ from the stored one."""
    _list_call(group, layout, digests, ws, log, locs, lookup, report_range, Phase.DIGEST_VERIFY)


def selected_tiles(
    plan_ws: PlanWorkspace, table_rows: torch.Tensor, epoch: int, period: int, group_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per active row: (first selected group, selected tiles, span start, span end), by the plan's spans.

    Every row selects the runs ``g`` with ``g % period == epoch % period``: a position read on ``period``
    consecutive steps is verified within them, whatever table row its request has on each step.
    """
    b = int(table_rows.shape[0])
    active = plan_ws.row_state[:b] == PlanWorkspace.ROW_ACTIVE
    start = plan_ws.window_starts[:b]
    count = plan_ws.verify_offsets[1 : b + 1] - plan_ws.verify_offsets[:b]
    end = torch.where(active, start + count, start)
    g = group_tokens
    lo = start // g
    hi = torch.where(end > start, (end + g - 1) // g, lo)
    phase = torch.full_like(table_rows.long(), epoch % period)

    def below(x: torch.Tensor) -> torch.Tensor:  # groups in [0, x) congruent to phase mod period
        return ((x - phase + period - 1) // period).clamp(min=0)

    tiles = below(hi) - below(lo)
    first = lo + (phase - lo) % period
    return first, tiles, start, end


def written_this_step(plan_ws: PlanWorkspace, slot: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Slots this step also writes (the link verify's write marks): their bytes may already be the new
    token's (a window ring reused in the step, read before the write; an engine verified after its
    forward), and the stamp digests them anew."""
    mark = 1 + int(plan_ws.epoch[0]) % PlanWorkspace.MARK_PERIOD
    marks = torch.zeros_like(slot)
    marks[valid] = plan_ws.write_marks[slot[valid]].long()
    return valid & ((marks >> 1) == mark)


def verify_planned(
    group: CanaryGroup, layout: DigestLayout, digests: torch.Tensor, ws: DigestWorkspace, log: ViolationLog,
    batch: StepBatch, plan_ws: PlanWorkspace, *, period: int, group_tokens: int = TILE_TOKENS,
    entries: int | None = None,
) -> None:  # fmt: skip
    """Verify the budgeted share of the last plan's verify entries (see the module docstring), at most
    ``entries`` of them (default: the workspace's)."""
    dev = batch.rows.device
    epoch = int(ws.epoch[0])
    first, tiles, start, end = selected_tiles(plan_ws, batch.rows, epoch, period, group_tokens)
    max_tiles = (ws.entries if entries is None else entries) // group_tokens
    offsets = torch.cumsum(tiles, 0) - tiles
    total = int(tiles.sum())
    kept = min(total, max_tiles)
    tile = torch.arange(kept, device=dev)
    r = torch.searchsorted(offsets + tiles, tile, right=True)
    grp = first[r] + (tile - offsets[r]) * period
    lane = torch.arange(group_tokens, device=dev)
    pos = (grp.unsqueeze(1) * group_tokens + lane).reshape(-1)
    r = r.repeat_interleave(group_tokens)
    inside = (pos >= start[r]) & (pos < end[r])
    trow = batch.rows.long()[r]
    full = torch.zeros_like(pos)
    if inside.any():
        full[inside] = table_slots(group, batch.table, trow[inside], pos[inside])
    res = resolve(group, batch.lookup, full, min(group.num_slots, layout.num_slots))
    usable = inside & res.in_pool & ~res.reserved
    usable &= ~written_this_step(plan_ws, res.slot, usable)
    stored, computed, mismatch = _check(group, layout, digests, res.slot, usable)
    ws.stats[DigestWorkspace.STAT_VERIFIED] += int(usable.sum())
    ws.stats[DigestWorkspace.STAT_SKIPPED_TILES] += total - kept
    ws.stats[DigestWorkspace.STAT_CALLS] += 1
    ws.epoch += 1
    out = _rows(int(mismatch.sum()), Phase.DIGEST_VERIFY, group, dev)
    out[:, Field.REASONS] = int(Reason.DIGEST_MISMATCH)
    out[:, Field.BATCH_ROW] = r[mismatch]
    out[:, Field.TABLE_ROW] = trow[mismatch]
    out[:, Field.SLOT] = res.slot[mismatch]
    out[:, Field.EXPECTED_POSITION] = pos[mismatch]
    out[:, Field.EXPECTED_LINK] = stored[mismatch]
    out[:, Field.STORED_LINK] = computed[mismatch]
    append_rows(log, out)


def stamp_entries(batch: StepBatch, ws: DigestWorkspace) -> int:
    """Workspace entries the stamp of ``batch``'s writes takes in :func:`verify_and_stamp` (whole tiles);
    ValueError when they exceed the workspace."""
    taken = -(-int(batch.out_cache_loc.shape[0]) // TILE_TOKENS) * TILE_TOKENS
    if taken > ws.entries:
        raise ValueError(f"{batch.out_cache_loc.shape[0]} writes exceed the digest workspace ({ws.entries} entries)")
    return taken


def verify_and_stamp(
    group: CanaryGroup, layout: DigestLayout, digests: torch.Tensor, ws: DigestWorkspace, log: ViolationLog,
    batch: StepBatch, plan_ws: PlanWorkspace, *, period: int, group_tokens: int = TILE_TOKENS,
) -> None:  # fmt: skip
    """:func:`verify_planned` then :func:`stamp_list` of ``batch.out_cache_loc`` (see the module docstring)."""
    taken = stamp_entries(batch, ws)
    verify_planned(group, layout, digests, ws, log, batch, plan_ws, period=period, group_tokens=group_tokens,
                   entries=ws.entries - taken)  # fmt: skip
    stamp_list(group, layout, digests, ws, log, batch.out_cache_loc, lookup=batch.lookup)
