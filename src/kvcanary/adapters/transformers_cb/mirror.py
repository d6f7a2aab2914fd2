"""Keep the records in step with the engine's bulk KV moves: block copies and CPU offload/restore.

The records describe what each slot holds, so whenever the engine moves KV bytes without a forward
(fork copies, offload to the CPU swap pool and restore into possibly different blocks) the records
must move the same way, or the next read of the moved blocks would be a false alarm.
"""

from __future__ import annotations

import torch

from kvcanary.adapters.transformers_cb.geometry import GroupGeometry
from kvcanary.layout import RecordStore


def copy_blocks(geometry: GroupGeometry, records: RecordStore, src_blocks: list[int], dst_blocks: list[int]) -> None:
    """Mirror ``CacheAllocator.copy_blocks``: whole blocks, src[i] -> dst[i]."""
    if not src_blocks:
        return
    dev = records.device
    src = geometry.block_slots(torch.tensor(src_blocks, dtype=torch.int64, device=dev))
    dst = geometry.block_slots(torch.tensor(dst_blocks, dtype=torch.int64, device=dev))
    records.copy_slots(src, dst)


class OffloadShadow:
    """Records of CPU-offloaded requests, in block-table order, until they are restored or dropped.

    transformers pairs blocks positionally: the k-th CPU block holds the k-th block of the request's
    GPU table, and on restore goes to the k-th block of its new table.  The shadow keeps the same order.
    """

    def __init__(self) -> None:
        self._saved: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._saved

    def __len__(self) -> int:
        return len(self._saved)

    def save(self, request_id: str, geometry: GroupGeometry, records: RecordStore, blocks: list[int]) -> None:
        slots = geometry.block_slots(torch.tensor(blocks, dtype=torch.int64, device=records.device))
        self._saved.setdefault(request_id, {})[geometry.name] = (
            records.tokens[slots],
            records.positions[slots],
            records.links[slots],
        )

    def restore(self, request_id: str, geometry: GroupGeometry, records: RecordStore, blocks: list[int]) -> bool:
        by_group = self._saved.get(request_id)
        saved = None if by_group is None else by_group.pop(geometry.name, None)
        if by_group is not None and not by_group:
            del self._saved[request_id]
        if saved is None:
            return False
        slots = geometry.block_slots(torch.tensor(blocks, dtype=torch.int64, device=records.device))
        n = min(int(slots.shape[0]), int(saved[0].shape[0]))
        records.tokens[slots[:n]] = saved[0][:n]
        records.positions[slots[:n]] = saved[1][:n]
        records.links[slots[:n]] = saved[2][:n]
        return True

    def drop(self, request_id: object) -> None:
        self._saved.pop(request_id, None)  # type: ignore[call-overload]

    def clear(self) -> None:
        self._saved.clear()
