"""Keep the records in step with the engine's bulk KV moves: block copies and CPU offload/restore.

The records describe what each slot holds, so whenever the engine moves KV bytes without a forward
(fork copies, offload to the CPU swap pool and restore into possibly different blocks) the records
must move the same way (into and out of the host pool too, host block by host block), or the next
read of the moved blocks would be a false alarm.  They move where
the bytes were seen to land (:mod:`.byte_moves`), not where the engine's bookkeeping says they should:
a copy that never lands or a restore into the wrong block then leaves records that disagree with the
reads, which the canary reports.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcanary.adapters.transformers_cb.byte_moves import BlockWrite, HostSave
from kvcanary.adapters.transformers_cb.geometry import GroupGeometry
from kvcanary.layout import RecordStore, block_index


def apply_block_write(geometry: GroupGeometry, records: RecordStore, write: BlockWrite) -> None:
    """Mirror one observed block write of a copy: records of the gathered blocks follow the bytes; bytes of
    unknown origin leave their destination blocks with no record (a later read is reported)."""
    dst = _blocks(write.dest, records.device)
    if write.source_blocks is None:
        records.clear_blocks(dst, geometry.page_size)
    else:
        records.copy_blocks(_blocks(write.source_blocks, records.device), dst, geometry.page_size)


class HostRecords:
    """Records of the engine's CPU swap pool, keyed by host block: what each host block's bytes hold.

    An offload copies the records of the device blocks it gathered into the host blocks the bytes were
    seen to land in (:meth:`save`); a restore copies the records of the host blocks it was seen to read
    into the device blocks it wrote (:meth:`restore`).  Nothing is keyed by request or table order, so a
    restore that reads a stale host block, or another request's, brings that block's records along and
    the next read of the restored blocks disagrees with them.  A host block never saved holds no record.
    One record store per group, allocated on the first offload, sized by the group's host view.
    """

    def __init__(self) -> None:
        self._stores: dict[str, RecordStore] = {}

    def __len__(self) -> int:
        return len(self._stores)

    def _store(self, geometry: GroupGeometry, host_blocks: int, device: torch.device) -> RecordStore:
        store = self._stores.get(geometry.name)
        if store is None or store.num_slots < host_blocks * geometry.page_size:
            store = RecordStore.allocate(host_blocks * geometry.page_size, device)
            self._stores[geometry.name] = store
        return store

    def _store_like(self, geometry: GroupGeometry, host_blocks: int, records: RecordStore) -> RecordStore:
        """The host store, carrying digests when the device records do (they travel with the bytes)."""
        store = self._store(geometry, host_blocks, records.device)
        if records.digests is not None:
            store.enable_digests()
        return store

    def save_all(
        self, geometry: GroupGeometry, records: RecordStore, saves: Sequence[HostSave], host_blocks: int
    ) -> None:
        """Mirror one offload's copies into the host pool (``host_blocks``: the rows of the group's host view).

        The engine copies an offload run by run (hundreds a demo run); mirrored one by one that was a dozen small
        device ops each.  Here consecutive runs are joined into one scatter until a host block repeats: a later
        copy into a block must land after the earlier one, which one scatter would not order."""
        store = self._store_like(geometry, host_blocks, records)
        batch: list[HostSave] = []
        blocks: set[int] = set()
        for save in saves:
            if not blocks.isdisjoint(save.host_blocks):
                _save_batch(geometry, store, records, batch)
                batch, blocks = [], set()
            batch.append(save)
            blocks.update(save.host_blocks)
        _save_batch(geometry, store, records, batch)

    def restore(self, geometry: GroupGeometry, records: RecordStore, write: BlockWrite) -> None:
        """Mirror one restore write: each written device block gets the records of the host block it was read
        from; blocks read from no known host block (or from a pool never saved into) get no record."""
        dst, page = _blocks(write.dest, records.device), geometry.page_size
        hosts = write.source_host_blocks or ()
        store = self._stores.get(geometry.name)
        if store is None or not hosts or min(hosts) < 0 or (max(hosts) + 1) * page > store.num_slots:
            records.clear_blocks(dst, page)
            return
        if (store.digests is None) != (records.digests is None):  # digests turned on after this store was made
            records.clear_blocks(dst, page)
            return
        records.copy_blocks(block_index(hosts, records.device), dst, page, source=store)

    def clear(self) -> None:
        self._stores.clear()


def _save_batch(geometry: GroupGeometry, store: RecordStore, records: RecordStore, batch: list[HostSave]) -> None:
    """Copies into distinct host blocks: the blocks of no known source cleared, the others copied, one op each."""
    device = records.device
    cleared: list[int] = []
    copied: list[int] = []  # the host blocks of the copies with a source, in the order of ``sources``
    sources: list[torch.Tensor] = []
    for save in batch:
        if save.source_blocks is None:
            cleared += save.host_blocks
        else:
            copied += save.host_blocks
            sources.append(save.source_blocks)
    page = geometry.page_size
    if cleared:
        store.clear_blocks(block_index(cleared, device), page)
    if not sources:
        return
    src = _blocks(sources[0] if len(sources) == 1 else torch.cat(sources), device)
    store.copy_blocks(src, block_index(copied, device), page, source=records)


def _blocks(ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Block numbers the engine indexed with, as the int64 index on the records' device that the moves take."""
    return ids.to(device, torch.int64, non_blocking=True)
