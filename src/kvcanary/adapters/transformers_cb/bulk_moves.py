"""The engine's bulk KV moves, mirrored into the records: fork block copies, CPU offload and restore.

Each wrapper runs the engine's own move under a :class:`~.byte_moves.BlockWriteObserver` and moves the
records the way the bytes were seen to move (:mod:`.mirror`): a fork copy from the gathered device
blocks to the written ones; an offload from the gathered device blocks into the host blocks the copy
landed in; a restore from the host blocks the copy read into the device blocks it wrote.  The
engine's bookkeeping (block tables, its request -> host block map) is never consulted, so a move whose
bytes go astray on either side leaves records that the next read of those blocks disagrees with.
A move the engine makes with one write a group (a restore, a fork's copies inside its ``perform_cache_copy``) is
mirrored as one where that orders the records as the writes did (:func:`.mirror.joined_restore`,
:func:`.mirror.joined_copy`): each mirrored op is a launch of host time on CUDA.
"""

from __future__ import annotations

import operator
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from kvcanary.adapters.transformers_cb import byte_moves, mirror, move_entries
from kvcanary.adapters.transformers_cb.binding import Binding
from kvcanary.adapters.transformers_cb.features import FeatureCounters
from kvcanary.runtime import streams

_OFFLOADED = operator.attrgetter("state.is_cpu_offloaded")  # a batch row's request is in the CPU swap pool


class BulkMoveWrappers:
    """Wrapper factories for :class:`~.patches.PatchSet` (``binding`` returns the adapter's current one)."""

    def __init__(self, binding: Callable[[], Binding | None], features: FeatureCounters) -> None:
        self._binding = binding
        self._features = features
        # Host time spent watching the engine's moves (the observer's set-up and its own work in each call; torch's
        # dispatch into it is not timed) and mirroring them into the records; the engine's own move left out.
        self.mirror_ns = 0
        self._views = byte_moves.BlockViews()  # the watched views' keys, rebuilt only when a cache tensor changes
        self._forks: list[tuple[str, byte_moves.BlockWrite]] | None = None  # in the engine's fork copy: its writes
        # The engine's offloading manager of a cache not bound yet, seen by the restore wrapper (which the engine calls
        # every step, before the forward whose tap makes the binding): see bound().
        self._offloader: weakref.ref[Any] | None = None

    def bound(self, b: Binding) -> None:
        """A binding was just made: where its cache's offloading manager was seen, its queue gets the swap pool's
        host records now (:func:`attach_host_rows`)."""
        om = None if self._offloader is None else self._offloader()
        self._offloader = None
        if om is not None and b.is_for(om.cache) and getattr(om, "_cpu_pool", None) is not None:
            attach_host_rows(b, om)

    def copy_blocks(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def copy_blocks(allocator: Any, source_block_ids: list[int], dest_block_ids: list[int]) -> Any:
            b = self._binding()
            if b is None or not b.owns_allocator(allocator):
                return original(allocator, source_block_ids, dest_block_ids)
            name = str(allocator.layer_type)
            start = time.perf_counter_ns()
            observer = byte_moves.BlockWriteObserver(self._views.keys({name: allocator}))
            self.mirror_ns += time.perf_counter_ns() - start
            with observer as seen:
                out = original(allocator, source_block_ids, dest_block_ids)
            self.mirror_ns += seen.own_ns
            self._features.fork_block_copies += len(source_block_ids)
            forks = [(name, write) for write in seen.writes]
            # Inside the engine's fork copy, mirrored with the other groups' copies at its end; with the KV digest at
            # once, as its moved bytes are verified right behind the copy (their records never join: see Binding.rows).
            if self._forks is not None and b.manager.digest_of(name) is None:
                self._forks += forks
                return out
            start = time.perf_counter_ns()
            _mirror_copies(b, forks)
            self.mirror_ns += time.perf_counter_ns() - start
            return out

        return copy_blocks

    def cache_copy(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """The engine's fork copy (every group's block copies, one ``copy_blocks`` a group): the groups' writes are
        mirrored together once it returns (:func:`_mirror_copies`), each still observed by its own group's wrapper."""

        def perform_cache_copy(cache: Any, copy_src_and_dst: Any) -> Any:
            b = self._binding()
            if b is None or not b.is_for(cache) or self._forks is not None:
                return original(cache, copy_src_and_dst)
            self._forks = []
            try:
                return original(cache, copy_src_and_dst)
            finally:  # the copies that landed are mirrored even if a later one raised
                forks, self._forks = self._forks, None
                if forks:
                    start = time.perf_counter_ns()
                    _mirror_copies(b, forks)
                    self.mirror_ns += time.perf_counter_ns() - start

        return perform_cache_copy

    def offload(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def _offload_to_cpu(om: Any, victims: list[Any], victim_block_tables: dict[str, Any]) -> Any:
            b = self._binding()
            if b is None or not b.is_for(om.cache) or getattr(om, "_cpu_pool", None) is None:
                return original(om, victims, victim_block_tables)
            with self._observer(b, om) as seen:
                done = original(om, victims, victim_block_tables)
            self.mirror_ns += seen.own_ns
            start = time.perf_counter_ns()
            if not _queued_saves(b, om, seen.host_saves):  # queued: the next step's work moves the records
                _save_at_once(b, om, seen.host_saves)
            self.mirror_ns += time.perf_counter_ns() - start
            self._features.offloads += len(done)
            self._features.soft_resets += len(victims) - len(done)
            return done

        return _offload_to_cpu

    def restore(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def restore_scheduled_requests(om: Any, requests_in_batch: list[Any]) -> Any:
            b = self._binding()
            ours = b is not None and b.is_for(om.cache)
            if not ours:  # the cache's binding is made in this step's tap
                self._offloader = weakref.ref(om)
            # Called every step: with no request in the swap pool (the engine's map empty) no row is scanned, and
            # otherwise the rows' flags are read in C (a generator over them cost about 0.15 us a row).
            restored = 0
            if ours and getattr(om, "_cpu_pool", None) is not None and getattr(om, "_request_id_to_cpu_blocks", True):
                restored = sum(map(_OFFLOADED, requests_in_batch))
            if b is None or not restored:
                return original(om, requests_in_batch)
            with self._observer(b, om) as seen:
                out = original(om, requests_in_batch)
            self.mirror_ns += seen.own_ns
            start = time.perf_counter_ns()
            if not _queued_restore(b, seen.writes):  # queued: the next step's work moves the records
                _restore_at_once(b, om, seen.writes)
            self.mirror_ns += time.perf_counter_ns() - start
            self._features.restores += restored
            return out

        return restore_scheduled_requests

    def _observer(self, b: Binding, om: Any) -> byte_moves.BlockWriteObserver:
        """The observer of an offload or restore, its set-up counted in :attr:`mirror_ns`."""
        start = time.perf_counter_ns()
        allocators = {n: a for n, a in om.cache.cache_allocators.items() if n in b.geometries}
        observer = byte_moves.BlockWriteObserver(self._views.keys(allocators), host_pool=om._cpu_tensor)
        self.mirror_ns += time.perf_counter_ns() - start
        return observer


def _mirror_copies(b: Binding, forks: list[tuple[str, byte_moves.BlockWrite]]) -> None:
    """Block copies (group, observed write), in the order they ran.  Where several groups' records are rows of one
    tensor pair and the writes join (:func:`mirror.joined_copy`), one gather and one write of the rows mirror them
    all, landing in every group's records alike (a block is one group's at a time: the others' records of it are
    never read before that group writes it); else each write goes into its own group's records."""
    q = b.moves
    if q is not None:
        if q.push(move_entries.fork_entries(q, forks)):
            return
        q.apply_now()  # the moves queued so far land first
    index = mirror.MoveIndex()  # the digest's notes use the mirror's index tensors
    names = {name for name, _ in forks}
    rows = b.rows(tuple(n for n in b.geometries if n in names)) if len(names) > 1 else None
    writes = [write for _, write in forks]
    if rows is not None and mirror.joined_copy(writes):
        page = b.geometries[forks[0][0]].page_size
        sources = [w.source_blocks for w in writes if w.source_blocks is not None]
        rows.copy_blocks(index.blocks(sources, rows.device), index.blocks([w.dest for w in writes], rows.device), page)
        return
    for name, write in forks:
        mirror.apply_block_write(b.geometries[name], b.records(name), write, index)
        _digest_moved(b, name, write, index)


def _save_at_once(b: Binding, om: Any, saves: list[byte_moves.HostSave]) -> None:
    """One offload's saves mirrored now, on the engine's compute stream, after any moves queued before them."""
    index = mirror.MoveIndex()  # the groups sharing a cache tensor share the saves' index tensors
    with streams.StreamSwitch(om._compute_stream):
        if b.moves is not None:
            b.moves.apply_now()
        if not _save_rows(b, om, saves, index):  # else group by group
            for name in dict.fromkeys(n for save in saves for n in save.groups):
                of_group = [save for save in saves if name in save.groups]
                rows = int(om._cpu_views[name].shape[0])
                b.host.save_all(b.geometries[name], b.records(name), of_group, rows, index)


def _restore_at_once(b: Binding, om: Any, writes: list[byte_moves.BlockWrite]) -> None:
    """One restore's writes mirrored now, on the engine's compute stream, after any moves queued before them."""
    index = mirror.MoveIndex()  # a write matching several groups (one cache tensor) builds its index once
    with streams.StreamSwitch(om._compute_stream):
        if b.moves is not None:
            b.moves.apply_now()
        joined = len(writes) > 1 and _restore_joined(b, writes, index)
        for write in writes:
            from_host = write.source_host_blocks is not None
            joint = joined or (from_host and _restore_rows(b, write, index))
            for name in write.groups:
                if not joint:  # else every group's records were restored at once
                    if from_host:
                        b.host.restore(b.geometries[name], b.records(name), write, index)
                    else:  # bytes of no host block: a device gather, or nothing known
                        mirror.apply_block_write(b.geometries[name], b.records(name), write, index)
                _digest_moved(b, name, write, index, om)


def attach_host_rows(b: Binding, om: Any) -> bool:
    """Give ``b``'s queue the host records of ``om``'s swap pool as rows of every group (each group's host view of one
    size), made on the engine's compute stream if there are none yet; False where the queue cannot take them.

    Done when the binding is made (:meth:`BulkMoveWrappers.bound`) where the engine's offloading manager is known then,
    so that the record-move launch, and with it every step's prelude, is built once: attached at the first offload
    instead, each shape class's step graph was captured a second time after it (about 1.7 ms a capture on an H100)."""
    q = b.moves
    views = getattr(om, "_cpu_views", None) or {}
    if q is None or not all(n in views for n in q.names):
        return False
    sizes = {int(views[n].shape[0]) for n in q.names}
    if len(sizes) != 1:
        return False
    slots = sizes.pop() * q.page
    host = b.host.joint_rows(q.names, slots, q.rows.device, create=False)
    if host is None:  # made on the stream the step work that reads them runs on
        with streams.StreamSwitch(om._compute_stream):
            host = b.host.joint_rows(q.names, slots, q.rows.device, create=True)
    if host is None:
        return False
    q.attach(host)
    return True


def _queued_saves(b: Binding, om: Any, saves: list[byte_moves.HostSave]) -> bool:
    """One offload's saves queued for the next step's work (:mod:`.queued_moves`), into the host records
    (:func:`attach_host_rows`); False, nothing queued, where the queue cannot take them.  No device work but the host
    rows' allocation, where the binding was made without them."""
    q = b.moves
    return q is not None and attach_host_rows(b, om) and q.push(move_entries.save_entries(q, saves))


def _queued_restore(b: Binding, writes: list[byte_moves.BlockWrite]) -> bool:
    """One restore's writes queued for the next step's work, where the host records the queue knows are the ones
    the mirror keeps (none yet on either side, or its rows); False otherwise."""
    q = b.moves
    if q is None:
        return False
    known = not len(b.host) if q.host is None else b.host.joint_rows(q.names, 0, q.rows.device, create=False) is q.host
    return known and q.push(move_entries.restore_entries(q, writes))


def _save_rows(b: Binding, om: Any, saves: list[byte_moves.HostSave], index: mirror.MoveIndex) -> bool:
    """One offload's saves mirrored into all their groups at once, where every save landed in the same groups and
    their records are rows of one tensor pair (:meth:`Binding.rows`) with host views of one size; False, nothing
    done, otherwise."""
    groups = {save.groups for save in saves}
    rows = b.rows(next(iter(groups))) if len(groups) == 1 else None
    if rows is None:
        return False
    (names,) = groups
    host_blocks = {int(om._cpu_views[n].shape[0]) for n in names}
    page = b.geometries[names[0]].page_size
    return len(host_blocks) == 1 and b.host.save_all_rows(names, page, rows, saves, host_blocks.pop(), index)


def _restore_rows(b: Binding, write: byte_moves.BlockWrite, index: mirror.MoveIndex) -> bool:
    """One restore write mirrored into all its groups at once, where their records are rows of one tensor pair and
    so are their host records; False, nothing done, otherwise."""
    rows = b.rows(write.groups)
    page = b.geometries[write.groups[0]].page_size
    return rows is not None and b.host.restore_rows(write.groups, page, rows, write, index)


def _restore_joined(b: Binding, writes: list[byte_moves.BlockWrite], index: mirror.MoveIndex) -> bool:
    """All of one restore's writes mirrored at once into all their groups (:meth:`mirror.HostRecords.restore_joined`),
    where their records are rows of one tensor pair and so are their host records; False, nothing done, otherwise."""
    rows = b.rows(writes[0].groups)
    page = b.geometries[writes[0].groups[0]].page_size
    return rows is not None and b.host.restore_joined(writes[0].groups, page, rows, writes, index)


def _digest_moved(b: Binding, name: str, write: byte_moves.BlockWrite, index: mirror.MoveIndex, om: Any = None) -> None:
    """With the KV digest on: note where the written blocks' bytes came from, and verify them (``index``: the move's
    index tensors, built once for the mirror and these notes).

    The source (the gathered device blocks of a fork copy, or the host blocks a restore read, through the
    swap pool's own layout: ``om``) is only remembered -- the tensors the move already has, no copy, no
    sync -- so that a later mismatch in these slots can be compared with it and its layer named
    (:meth:`~kvcanary.digest_canary.GroupDigest.note_move`).  The written blocks' bytes are then verified
    against the digests that moved with their records (queued after the move on the same stream, so it
    reads the bytes that landed).

    The verify runs only when the cache holds one group: with several (a hybrid model), the groups' blocks
    share one tensor, so a block's never-read slots may carry one group's old digest over bytes another
    group wrote since (its sector changed hands); a copied block would then be reported for bytes nobody
    reads.  There the moved slots are checked by the budgeted verify when they are read.
    """
    digest = b.manager.digest_of(name)
    if digest is None:
        return
    geometry, device = b.geometries[name], b.records(name).device
    dest = geometry.block_slots(index.blocks((write.dest,), device))
    hosts = write.source_host_blocks
    if write.source_blocks is not None:
        digest.note_move(dest, geometry.block_slots(index.blocks((write.source_blocks,), device)))
    elif hosts and min(hosts) >= 0 and om is not None:
        layout = b.host_layout(name, om)
        if layout is not None:  # host block numbers are host ints: the source slots stay on the CPU
            src = geometry.block_slots(torch.tensor(hosts, dtype=torch.int64))
            digest.note_move(dest, src, layout, "host copy")
    if len(b.geometries) == 1:
        b.manager.verify_moved(name, dest)
