"""Records follow what vLLM does to whole blocks between steps (``GPUModelRunner._update_states``).

* ``new_block_ids_to_zero``: freshly allocated blocks of full-attention groups are zeroed, so their records
  are cleared (a read of such a slot before it is written is a read of zeros: ``unwritten``);
* ``kv_cache_block_copies`` ((src, dst) scheduler block pairs: copy-on-write of a partially hit prefix block):
  the bytes of every group move, so the records move with them, after the zeroing (vLLM's order); with the KV
  digest on, the destinations' bytes are then verified against the digests that moved with the records.

Block ids are scheduler blocks: slots ``[b * block_size, (b + 1) * block_size)`` of the group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvcanary.adapters.vllm.groups import VllmGroup
from kvcanary.layout import RecordStore, block_index


def block_slots(blocks: Sequence[int], block_size: int, device: torch.device) -> torch.Tensor:
    ids = block_index(blocks, device)
    offsets = torch.arange(block_size, dtype=torch.int64, device=device)
    return (ids[:, None] * block_size + offsets[None, :]).reshape(-1)


def _pool_blocks(group: VllmGroup) -> int:
    """Whole blocks in the group's pool: ids at or past it are outside what the canary holds."""
    return group.canary.num_slots // group.block_size


def _in_pool(blocks: Sequence[int], group: VllmGroup) -> list[int]:
    limit = _pool_blocks(group)
    return [int(b) for b in blocks if 0 <= int(b) < limit]


def apply_zeroing(group: VllmGroup, records: RecordStore, blocks: Sequence[int]) -> int:
    """Clear the records of zeroed blocks; returns how many blocks."""
    if not group.zeroed_on_reuse or not blocks:
        return 0
    ids = _in_pool(blocks, group)
    if ids:
        records.clear_blocks(block_index(ids, records.device), group.block_size)
    return len(ids)


def copied_slots(
    group: VllmGroup, copies: Sequence[tuple[int, int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(source slots, destination slots) of the in-pool (src, dst) block pairs, or None when there are none."""
    pairs = _pairs_in_pool(group, copies)
    if not pairs:
        return None
    src = block_slots([s for s, _ in pairs], group.block_size, device)
    return src, block_slots([d for _, d in pairs], group.block_size, device)


def _pairs_in_pool(group: VllmGroup, copies: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    limit = _pool_blocks(group)
    pairs = [(int(s), int(d)) for s, d in copies]
    return [(s, d) for s, d in pairs if 0 <= s < limit and 0 <= d < limit]


def apply_copies(group: VllmGroup, records: RecordStore, copies: Sequence[tuple[int, int]]) -> int:
    """Copy the records of (src, dst) block pairs, all sources read before any destination is written (whole blocks:
    one gather and one write a field, :meth:`~kvcanary.layout.RecordStore.copy_blocks`)."""
    pairs = _pairs_in_pool(group, copies)
    if not pairs:
        return 0
    src, dst = (block_index(ids, records.device) for ids in zip(*pairs, strict=True))
    records.copy_blocks(src, dst, group.block_size)
    return len(pairs)


def fresh_blocks(so: Any, group: VllmGroup) -> list[int]:
    """Blocks newly given to requests this step (not their prefix-cache hits), from the scheduler output."""
    out: list[int] = []
    for req in so.scheduled_new_reqs:
        out += list(req.block_ids[group.index])[req.num_computed_tokens // group.block_size :]
    cached = so.scheduled_cached_reqs
    for rid, ids, computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True):
        if ids is not None:
            skip = computed // group.block_size if rid in cached.resumed_req_ids else 0
            out += list(ids[group.index])[skip:]
    return out


def count_written(group: VllmGroup, records: RecordStore, blocks: Sequence[int]) -> int:
    """How many of ``blocks`` hold written records: blocks freed or evicted, then given out again."""
    ids = _in_pool(blocks, group)
    if not ids:
        return 0
    links = records.links[block_slots(ids, group.block_size, records.device)].view(len(ids), group.block_size)
    return int((links != 0).any(1).sum())
