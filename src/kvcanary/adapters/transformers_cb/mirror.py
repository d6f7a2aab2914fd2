"""Keep the records in step with the engine's bulk KV moves: block copies and CPU offload/restore.

The records describe what each slot holds, so whenever the engine moves KV bytes without a forward
(fork copies, offload to the CPU swap pool and restore into possibly different blocks) the records
must move the same way, or the next read of the moved blocks would be a false alarm.  They move where
the bytes were seen to land (:mod:`.byte_moves`), not where the engine's bookkeeping says they should:
a copy that never lands or a restore into the wrong block then leaves records that disagree with the
reads, which the canary reports.
"""

from __future__ import annotations

import torch

from kvcanary.adapters.transformers_cb.byte_moves import BlockWrite
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


def apply_block_write(geometry: GroupGeometry, records: RecordStore, write: BlockWrite) -> None:
    """Mirror one observed block write of a copy: records of the gathered blocks follow the bytes; bytes of
    unknown origin leave their destination blocks with no record (a later read is reported)."""
    dst = geometry.block_slots(write.dest.to(records.device, non_blocking=True))
    if write.source_blocks is None:
        records.clear_slots(dst)
    else:
        records.copy_slots(geometry.block_slots(write.source_blocks.to(records.device, non_blocking=True)), dst)


class OffloadShadow:
    """Records of CPU-offloaded requests, in block-table order, until they are restored or dropped.

    transformers pairs blocks positionally: the k-th CPU block holds the k-th block of the request's
    GPU table.  The shadow keeps the same order; on restore the saved pages go to the blocks the restore's
    copy wrote them into (see :func:`restore_observed`).
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

    def saved_blocks(self, request_id: str, geometry: GroupGeometry) -> int:
        """How many blocks of ``request_id`` in ``geometry``'s group are saved (0 when none)."""
        saved = self._saved.get(request_id, {}).get(geometry.name)
        return 0 if saved is None else int(saved[0].shape[0]) // geometry.page_size

    def discard(self, request_id: str, geometry: GroupGeometry) -> None:
        """Forget one group's saved records of ``request_id`` (restored elsewhere or not at all)."""
        by_group = self._saved.get(request_id)
        if by_group is not None:
            by_group.pop(geometry.name, None)
            if not by_group:
                del self._saved[request_id]

    def restore(
        self, request_id: str, geometry: GroupGeometry, records: RecordStore, blocks: list[int] | torch.Tensor
    ) -> bool:
        """Write the saved records into ``blocks`` (saved block k -> blocks[k]; the shorter of the two decides)."""
        saved = self._saved.get(request_id, {}).get(geometry.name)
        self.discard(request_id, geometry)
        if saved is None:
            return False
        ids = blocks if isinstance(blocks, torch.Tensor) else torch.tensor(blocks, dtype=torch.int64)
        slots = geometry.block_slots(ids.to(records.device, non_blocking=True))
        n = min(int(slots.shape[0]), int(saved[0].shape[0]))
        records.tokens[slots[:n]] = saved[0][:n]
        records.positions[slots[:n]] = saved[1][:n]
        records.links[slots[:n]] = saved[2][:n]
        return True

    def drop(self, request_id: object) -> None:
        self._saved.pop(request_id, None)  # type: ignore[call-overload]

    def clear(self) -> None:
        self._saved.clear()


def restore_observed(
    shadow: OffloadShadow,
    request_ids: list[str],
    table_lengths: dict[str, dict[str, int]],
    geometries: dict[str, GroupGeometry],
    records: dict[str, RecordStore],
    writes: list[BlockWrite],
) -> None:
    """Mirror one ``restore_scheduled_requests`` from the block writes seen while it ran.

    The engine restores a group in one block write whose rows are the requests' saved pages, request after
    request in batch order, ``min(saved blocks, new table length)`` each: the pages are paired with the
    written destinations in that order.  A group whose write is missing or has another length gets no
    records: its requests' saved records are dropped and their reads are reported.
    """
    pending = list(writes)
    for name, geometry in geometries.items():
        saved = [shadow.saved_blocks(rid, geometry) for rid in request_ids]
        if not any(saved):
            continue
        counts = [min(k, table_lengths.get(rid, {}).get(name, 0)) for k, rid in zip(saved, request_ids, strict=True)]
        write = next((w for w in pending if name in w.groups), None)
        if write is not None:
            pending.remove(write)
        if write is None or int(write.dest.shape[0]) != sum(counts):
            for rid in request_ids:
                shadow.discard(rid, geometry)
            continue
        offset = 0
        for rid, n in zip(request_ids, counts, strict=True):
            shadow.restore(rid, geometry, records[name], write.dest[offset : offset + n])
            offset += n
