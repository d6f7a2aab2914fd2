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

from collections.abc import Iterator, Sequence
from typing import TypeVar

import torch

from kvcanary.adapters.transformers_cb.byte_moves import BlockWrite, HostSave
from kvcanary.adapters.transformers_cb.geometry import GroupGeometry
from kvcanary.layout import Blocks, RecordRows, RecordStore, block_index, block_run


class MoveIndex:
    """The index tensors of one move's mirror, built once and shared by every group a write is mirrored into.

    On the hybrid model the groups share one cache tensor: each observed write (and each offload's saves) matches
    them all and is mirrored once per group, over the same block numbers.  Each index is an op or two of host time
    on CUDA (host block numbers: a pinned tensor and its copy, unless they are a run, see :meth:`hosts`), so it is
    built for the first group only.  Keyed by what it is built from and the records' device; the key's tensors are
    held so that their ``id`` cannot be reused while the cache lives.  One per move: not kept across moves (nor
    streams).
    """

    def __init__(self) -> None:
        self._ids: dict[tuple[tuple[int, ...], torch.device], tuple[Sequence[torch.Tensor], torch.Tensor]] = {}
        self._hosts: dict[tuple[tuple[int, ...], torch.device], Blocks] = {}

    def blocks(self, ids: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
        """The engine's block-number tensors ``ids``, joined, as the int64 index on ``device`` (:func:`_blocks`)."""
        key = (tuple(map(id, ids)), device)
        kept = self._ids.get(key)
        if kept is None:
            kept = self._ids[key] = (ids, _blocks(ids[0] if len(ids) == 1 else torch.cat(list(ids)), device))
        return kept[1]

    def joined(
        self, first: Sequence[int], second: Sequence[int], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Two lists of block numbers as int64 indices on ``device``, built as one index (one copy on CUDA, where the
        other end built from the engine's tensors would take a join of those too); None where either is a run (a
        view, no index: see :meth:`hosts`)."""
        if block_run(first) is not None or block_run(second) is not None:
            return None
        both = block_index([*first, *second], device)
        return both[: len(first)], both[len(first) :]

    def hosts(self, blocks: Sequence[int], device: torch.device) -> Blocks:
        """Host block numbers as the int64 index on ``device`` (:func:`~kvcanary.layout.block_index`), or as a slice
        where they are a run (:func:`~kvcanary.layout.block_run`: no index built, no copy sent, no gather)."""
        key = (tuple(blocks), device)
        index = self._hosts.get(key)
        if index is None:
            run = block_run(key[0])
            index = self._hosts[key] = block_index(key[0], device) if run is None else run
        return index


def apply_block_write(
    geometry: GroupGeometry, records: RecordStore, write: BlockWrite, index: MoveIndex | None = None
) -> None:
    """Mirror one observed block write of a copy: records of the gathered blocks follow the bytes; bytes of
    unknown origin leave their destination blocks with no record (a later read is reported).  ``index``: the
    move's index tensors, shared with the other groups the write is mirrored into (:class:`MoveIndex`)."""
    index = MoveIndex() if index is None else index
    dst = index.blocks((write.dest,), records.device)
    if write.source_blocks is None:
        records.clear_blocks(dst, geometry.page_size)
    else:
        records.copy_blocks(index.blocks((write.source_blocks,), records.device), dst, geometry.page_size)


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
        self._joint: dict[tuple[str, ...], tuple[RecordRows, list[RecordStore]]] = {}  # rows made for groups at once

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
        self,
        geometry: GroupGeometry,
        records: RecordStore,
        saves: Sequence[HostSave],
        host_blocks: int,
        index: MoveIndex | None = None,
    ) -> None:
        """Mirror one offload's copies into the host pool (``host_blocks``: the rows of the group's host view;
        ``index``: the offload's index tensors, shared by the groups it is mirrored into).

        The engine copies an offload run by run (hundreds a demo run); mirrored one by one that was a dozen small
        device ops each.  Here consecutive runs are joined into one scatter until a host block repeats: a later
        copy into a block must land after the earlier one, which one scatter would not order."""
        store = self._store_like(geometry, host_blocks, records)
        index = MoveIndex() if index is None else index
        for batch in _batches(saves):
            _save_batch(geometry.page_size, store, records, batch, index)

    def restore(
        self, geometry: GroupGeometry, records: RecordStore, write: BlockWrite, index: MoveIndex | None = None
    ) -> None:
        """Mirror one restore write: each written device block gets the records of the host block it was read
        from; blocks read from no known host block (or from a pool never saved into) get no record.  ``index``:
        the restore's index tensors, shared with the other groups the write is mirrored into."""
        index = MoveIndex() if index is None else index
        store = self._stores.get(geometry.name)
        if store is not None and (store.digests is None) != (records.digests is None):
            store = None  # digests turned on after this store was made: its records do not carry them
        _restore_write(geometry.page_size, records, store, write, index)

    def save_all_rows(
        self, names: tuple[str, ...], page: int, rows: RecordRows, saves: Sequence[HostSave], host_blocks: int,
        index: MoveIndex,
    ) -> bool:  # fmt: skip
        """:meth:`save_all` for groups ``names`` at once, their device records the rows ``rows`` (every save's
        groups being ``names``): into host records laid out as rows too; False, nothing done, where the groups'
        host records exist as separate stores or too small (then save them one by one)."""
        store = self.joint_rows(names, host_blocks * page, rows.device, create=True)
        if store is None:
            return False
        for batch in _batches(saves):
            _save_batch(page, store, rows, batch, index)
        return True

    def restore_rows(
        self, names: tuple[str, ...], page: int, rows: RecordRows, write: BlockWrite, index: MoveIndex
    ) -> bool:
        """:meth:`restore` for groups ``names`` at once (``rows``: their device records); False, nothing done, where
        their host records are not rows of one tensor pair (then restore them one by one)."""
        store = self.joint_rows(names, 0, rows.device, create=False)
        if store is None:
            return False
        _restore_write(page, rows, store, write, index)
        return True

    def restore_joined(
        self, names: tuple[str, ...], page: int, rows: RecordRows, writes: Sequence[BlockWrite], index: MoveIndex
    ) -> bool:
        """:meth:`restore_rows` for all of one restore's ``writes`` at once (:func:`joined_restore`); False, nothing
        done, where they cannot be joined (then restore them one by one)."""
        store = self.joint_rows(names, 0, rows.device, create=False)
        joined = None if store is None else joined_restore(writes, names, store.num_slots // page)
        if store is None or joined is None:
            return False
        both = index.joined(*joined, rows.device)
        if both is None:  # a run of host blocks (a view): the destinations joined from the engine's tensors
            dst, src = index.blocks([w.dest for w in writes], rows.device), index.hosts(joined[1], rows.device)
        else:
            dst, src = both
        rows.copy_blocks(src, dst, page, source=store)
        return True

    def joint_rows(self, names: tuple[str, ...], slots: int, device: torch.device, create: bool) -> RecordRows | None:
        """The host records of ``names`` as rows of one tensor pair, of at least ``slots`` slots: the ones made for
        them, while each group's store is still its view of them, or (``create``, where none of the groups has a
        store) new ones, each group's store a view of its rows."""
        joint = self._joint.get(names)
        if joint is not None and all(self._stores.get(n) is s for n, s in zip(names, joint[1], strict=True)):
            return joint[0] if joint[0].num_slots >= slots else None
        if not create or any(n in self._stores for n in names):
            return None
        rows = RecordRows.allocate(slots, len(names), device)
        stores = rows.stores()
        self._stores.update(zip(names, stores, strict=True))
        self._joint[names] = (rows, stores)
        return rows

    def clear(self) -> None:
        self._stores.clear()
        self._joint.clear()


def joined_restore(
    writes: Sequence[BlockWrite], groups: tuple[str, ...], host_blocks: int
) -> tuple[list[int], list[int]] | None:
    """One restore's writes as one write (its destination and source host blocks), or None where that would not
    mirror them as they land one after another.

    The engine restores each group's blocks with a write of its own, and on the hybrid model every write lands in
    both groups: two writes mirrored one by one took two index builds, gathers and writes per record tensor.  Joined
    they take one of each, which leaves the records as the writes one by one would where each write lands in
    ``groups``, reads host blocks all known and within the ``host_blocks`` of the host records (one that does not
    leaves its destination without a record, the others keep theirs), and the destination blocks, known from the
    host lists the engine built them from, are distinct (a block written twice keeps the last write's bytes, which
    one scatter would not order)."""
    dests: list[int] = []
    hosts: list[int] = []
    for write in writes:
        known = write.source_host_blocks
        if write.groups != groups or write.dest_values is None or not known or min(known) < 0:
            return None
        if max(known) >= host_blocks:
            return None
        dests += write.dest_values
        hosts += known
    if len(writes) < 2 or len(set(dests)) != len(dests):
        return None
    return dests, hosts


def joined_copy(writes: Sequence[BlockWrite]) -> bool:
    """Whether block copies (a fork's, one write for each group) mirrored as one gather and one write leave the records
    as the writes one after another would: each write's source and destination blocks known from the host lists the
    engine built them from, the destinations distinct, and none of them a later write's source (one gather reads
    every source before any block is written)."""
    written: set[int] = set()
    count = 0
    for write in writes:
        src, dst = write.source_values, write.dest_values
        if src is None or dst is None or not written.isdisjoint(src):
            return False
        count += len(dst)
        written.update(dst)
        if len(written) != count:  # a block written twice
            return False
    return len(writes) > 1


def _batches(saves: Sequence[HostSave]) -> Iterator[list[HostSave]]:
    """Consecutive saves joined until a host block repeats (see :meth:`HostRecords.save_all`)."""
    batch: list[HostSave] = []
    blocks: set[int] = set()
    for save in saves:
        if not blocks.isdisjoint(save.host_blocks):
            yield batch
            batch, blocks = [], set()
        batch.append(save)
        blocks.update(save.host_blocks)
    yield batch


_Records = TypeVar("_Records", RecordStore, RecordRows)  # one group's store, or several groups' rows


def _restore_write(page: int, records: _Records, store: _Records | None, write: BlockWrite, index: MoveIndex) -> None:
    """Each device block ``write`` wrote gets the records of the host block of ``store`` it was read from; none where
    a host block is unknown or past the host records, or there are none (``store`` None)."""
    dst = index.blocks((write.dest,), records.device)
    hosts = write.source_host_blocks or ()
    if store is None or not hosts or min(hosts) < 0 or (max(hosts) + 1) * page > store.num_slots:
        records.clear_blocks(dst, page)
    else:
        records.copy_blocks(index.hosts(hosts, records.device), dst, page, source=store)


def _save_batch(page: int, store: _Records, records: _Records, batch: list[HostSave], index: MoveIndex) -> None:
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
    if cleared:
        store.clear_blocks(index.hosts(cleared, device), page)
    if not sources:
        return
    known = [save.source_values for save in batch if save.source_blocks is not None]
    values = [b for v in known if v is not None for b in v]
    both = index.joined(values, copied, device) if len(values) == len(copied) else None  # every source known
    if both is None:
        store.copy_blocks(index.blocks(sources, device), index.hosts(copied, device), page, source=records)
    else:
        store.copy_blocks(both[0], both[1], page, source=records)


def _blocks(ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Block numbers the engine indexed with, as the int64 index on the records' device that the moves take."""
    return ids.to(device, torch.int64, non_blocking=True)
