"""Index resolution for the reference: table index -> pool slot, each failure with its own reason."""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvcanary.batch import StepBatch
from kvcanary.layout import CanaryGroup
from kvcanary.schema import UNKNOWN_TOKEN


def table_slots(group: CanaryGroup, table: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Table entry for (row, pos), in the table's index space; rows and pos must be in range."""
    if group.page_size == 1:
        return table[rows, pos].long()
    page = group.page_size
    return table[rows, pos // page].long() * page + pos % page


def through_lookup(lookup: torch.Tensor | None, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Map table indices into the group's pool; returns (slot, lookup_out_of_range)."""
    if lookup is None:
        return full, torch.zeros_like(full, dtype=torch.bool)
    n = lookup.shape[0]
    bad = (full < 0) | (full >= n)
    slot = lookup[full.clamp(0, max(n - 1, 0))].long() if n > 0 else torch.zeros_like(full)
    return torch.where(bad, torch.full_like(slot, -1), slot), bad


def in_pool(slot: torch.Tensor, num_slots: int) -> torch.Tensor:
    return (slot >= 0) & (slot < num_slots)


def is_reserved(group: CanaryGroup, slot: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(slot, dtype=torch.bool)
    for s in group.reserved_slots:
        out |= slot == s
    return out


class Resolved(NamedTuple):
    """One lookup of table indices into the pool, with the reason each index fails, if any."""

    slot: torch.Tensor  # the pool slot (-1 when the lookup failed; the raw value when out of the pool)
    lookup_bad: torch.Tensor  # the index is outside the lookup table
    out_of_pool: torch.Tensor  # the looked-up slot is outside the pool
    in_pool: torch.Tensor  # safe to dereference (reserved slots included)
    reserved: torch.Tensor  # in the pool but a reserved slot


def resolve(group: CanaryGroup, lookup: torch.Tensor | None, full: torch.Tensor, num_slots: int) -> Resolved:
    slot, lookup_bad = through_lookup(lookup, full)
    ok = in_pool(slot, num_slots) & ~lookup_bad
    return Resolved(slot, lookup_bad, ~lookup_bad & ~ok, ok, ok & is_reserved(group, slot))


def expected_tokens(group: CanaryGroup, batch: StepBatch, batch_rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Ground-truth token at ``pos + token_offset`` (int64, -1 = unknown) for each (batch row, pos)."""
    if batch.truth is None or batch.truth_lens is None:
        return torch.full_like(pos, UNKNOWN_TOKEN)
    truth, lens = batch.truth, batch.truth_lens.long()
    table_rows = batch.rows.long()[batch_rows]
    idx = pos + group.token_offset
    ok = (
        (idx >= 0)
        & (idx < lens[batch_rows])
        & (idx < truth.shape[1])
        & (table_rows >= 0)
        & (table_rows < truth.shape[0])
    )
    if truth.numel() == 0:
        return torch.full_like(pos, UNKNOWN_TOKEN)
    tok = truth[table_rows.clamp(0, truth.shape[0] - 1), idx.clamp(0, truth.shape[1] - 1)]
    return torch.where(ok, tok.to(torch.int32).long(), torch.full_like(pos, UNKNOWN_TOKEN))
