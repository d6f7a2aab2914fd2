"""Records travel with the bytes through sglang's HiCache host pool, both ways, keyed by host index.

HiCache backs device KV up into a host pool (``HostKVCache.backup_from_device_all_layer(device_pool,
host_indices, device_indices, io_backend)``) and loads it back, layer by layer, into possibly other device
slots (``load_to_device_per_layer(device_pool, host_indices, device_indices, layer_id, io_backend)``).
Those two calls are what move the bytes: their index arguments are the transfer kernels' sources and
destinations.  :class:`HostRecordMirror` wraps them on one host pool:

* backup: the records of the device slots read go to a host record store at the host indices written;
* load: the device slots written get the records saved at the host indices read; a host index that was
  never backed up (or is out of the pool) leaves its device slot with no record.

Nothing is keyed by request, radix node or table order, so a load that reads the wrong host slots (stale
ones, another prefix's) brings *their* records along, and the next read of the restored slots disagrees
with them: a violation at that read (``token``/``position``/``link_mismatch``, or ``never_written``).

With the KV digest on, digests travel with the records, but a load is layer by layer and may overlap the
forward that reads it, so a restored slot's digest is held back (0: not compared) until the canary's next
host step, when every layer has landed: then it is put in place and the slots are verified
(``verify_moved``), with the host copy remembered so that a mismatch names the layer that differs.

Install after :func:`~kvcanary.adapters.sglang.install_canary`, where the scheduler has built its HiCache
(``tree_cache.cache_controller.mem_pool_host``)::

    mirror = attach_host_pool(model_runner.kv_canary, tree_cache.cache_controller.mem_pool_host)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvcanary.adapters.patching import PatchSet
from kvcanary.adapters.sglang.digest_layout import host_layout
from kvcanary.layout import RecordStore

SUPPORTED_HOST_POOLS = ("MHATokenToKVPoolHost", "MLATokenToKVPoolHost")


class HostRecordMirror:
    """The records of one sglang host pool, and the two wrapped transfers that move them (see module doc)."""

    def __init__(self, canary: Any, host_pool: Any, *, group: str = "full") -> None:
        name = type(host_pool).__name__
        if name not in SUPPORTED_HOST_POOLS:
            raise TypeError(
                f"kvcanary cannot follow host pool class {name}; supported: {', '.join(SUPPORTED_HOST_POOLS)}"
            )
        if canary.attached.window_group is not None:
            raise ValueError("host-pool records for sliding-window (SWA) pools are not supported")
        size = getattr(host_pool, "size", None)
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise TypeError(f"{name}.size must be a positive int, got {size!r}")
        self.canary = canary
        self.group = group
        self.device_records: RecordStore = canary.manager.canaries[group].records
        self.host_records = RecordStore.allocate(size + int(host_pool.page_size), self.device_records.device)
        if self.device_records.digests is not None:
            self.host_records.enable_digests()
        self.host_pool = host_pool
        self.saves = 0
        self.restores = 0
        self._loading: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device, host) slots whose digests wait
        digest = canary.manager.digest_of(group)
        self.host_layout = None if digest is None else host_layout(host_pool, digest.layout)
        canary.after_host_step.append(self.verify_loads)
        self._patches = PatchSet(exclusive=False)
        self._patches.wrap(host_pool, "backup_from_device_all_layer", self._backup)
        self._patches.wrap(host_pool, "load_to_device_per_layer", self._load)

    def detach(self) -> None:
        self._patches.restore()
        if self.verify_loads in self.canary.after_host_step:
            self.canary.after_host_step.remove(self.verify_loads)

    # ------------------------------------------------------------------ the wrapped transfers

    def _backup(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        def backup(device_pool: Any, host_indices: Any, device_indices: Any, *args: Any, **kwargs: Any) -> Any:
            out = forward(device_pool, host_indices, device_indices, *args, **kwargs)
            self.save(host_indices, device_indices)
            return out

        return backup

    def _load(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        def load(
            device_pool: Any, host_indices: Any, device_indices: Any, layer_id: int, *args: Any, **kwargs: Any
        ) -> Any:
            out = forward(device_pool, host_indices, device_indices, layer_id, *args, **kwargs)
            if layer_id == 0 and not kwargs.get("is_draft", False):  # records are per token: once per load
                self.restore(host_indices, device_indices)
            return out

        return load

    # ------------------------------------------------------------------ the record moves

    def save(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        """Backup: host record[host_indices[i]] = device record[device_indices[i]] (out-of-range pairs skipped)."""
        host, dev = self._pairs(host_indices, device_indices)
        for h, d in zip(_fields(self.host_records), _fields(self.device_records), strict=True):
            h[host] = d[dev]
        self.saves += 1

    def restore(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        """Load: device record[device_indices[i]] = host record[host_indices[i]]; a device slot written from an
        out-of-range host index gets no record."""
        dev_all = _as_index(device_indices, self.device_records.device)
        host_all = _as_index(host_indices, self.device_records.device)
        n = min(int(dev_all.shape[0]), int(host_all.shape[0]))
        dev_all, host_all = dev_all[:n], host_all[:n]
        dev_ok = (dev_all >= 0) & (dev_all < self.device_records.num_slots)
        self.device_records.clear_slots(dev_all[dev_ok])
        host, dev = self._pairs(host_all, dev_all)
        for d, h in zip(_fields(self.device_records)[:3], _fields(self.host_records)[:3], strict=True):
            d[dev] = h[host]
        if self.device_records.digests is not None:  # in place once every layer has landed (verify_loads)
            self._loading.append((dev, host))
        self.restores += 1

    def verify_loads(self) -> None:
        """After the host step of the forward a load overlapped: put the loaded slots' digests in place and
        verify their bytes (findings come with the next step's report)."""
        loading, self._loading = self._loading, []
        digest = self.canary.manager.digest_of(self.group)
        if digest is None or self.device_records.digests is None or self.host_records.digests is None:
            return
        for dev, host in loading:
            self.device_records.digests[dev] = self.host_records.digests[host]
            if self.host_layout is not None:
                digest.note_move(dev, host, self.host_layout, "host copy")
            self.canary.manager.verify_moved(self.group, dev)

    def _pairs(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(host, device) index pairs that lie inside both record stores: never an out-of-bounds access."""
        host = _as_index(host_indices, self.device_records.device)
        dev = _as_index(device_indices, self.device_records.device)
        n = min(int(host.shape[0]), int(dev.shape[0]))
        host, dev = host[:n], dev[:n]
        ok = (host >= 0) & (host < self.host_records.num_slots) & (dev >= 0) & (dev < self.device_records.num_slots)
        return host[ok], dev[ok]


def attach_host_pool(canary: Any, host_pool: Any, *, group: str = "full") -> HostRecordMirror:
    """Follow ``host_pool``'s backups and loads with ``canary``'s records (see :class:`HostRecordMirror`)."""
    return HostRecordMirror(canary, host_pool, group=group)


def _as_index(indices: Any, device: torch.device) -> torch.Tensor:
    if not isinstance(indices, torch.Tensor) or indices.dim() != 1 or indices.dtype.is_floating_point:
        raise TypeError(f"host/device indices must be a 1-D integer tensor, got {indices!r:.80}")
    return indices.to(device=device, dtype=torch.int64)


def _fields(records: RecordStore) -> tuple[torch.Tensor, ...]:
    fields = (records.tokens, records.positions, records.links)
    return fields if records.digests is None else (*fields, records.digests)
