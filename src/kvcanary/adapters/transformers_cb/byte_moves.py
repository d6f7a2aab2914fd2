"""Watch where the engine's bulk KV moves actually write, so the records follow the bytes.

The engine moves KV without a forward (fork copies, CPU-offload restores) by writing whole blocks into
its cache tensor viewed as ``[blocks, bytes_per_block]``.  Mirroring the engine's *bookkeeping* (the
arguments of ``copy_blocks``, the request's block table after a restore) would move the records where
the bytes should be; a bug that sends the bytes elsewhere (a copy that never lands, a restore into the
wrong block) would then leave records and reads in agreement over misplaced bytes.  So while such a move
runs, a torch function mode sees every tensor call the engine makes and keeps the ones that write into a
watched block view: the records are then moved to exactly those destinations.  Ops run as they would anyway
(no extra device work, no host sync); only the index tensors are kept.  A function mode rather than a
dispatch mode: it sees the engine's Python calls only (the three that move blocks among them), not every
aten op each decomposes into, and costs a few microseconds a call where a dispatch mode cost tens (on the
CPU demo the moves took 0.16 ms each under the dispatch mode).

CPU offload and restore go through the engine's host swap pool: an offload gathers device blocks and
copies row runs of the gathered tensor into host rows; a restore copies host row runs into a device
staging tensor and scatters the staging rows into device blocks.  With the host pool watched too, the
observer pairs each host block with the device blocks its bytes came from (:class:`HostSave`) and each
restored device block with the host block its bytes were read from (:attr:`BlockWrite.source_host_blocks`),
taken from the copies' own storage offsets -- host-side integers, no device sync.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# The engine's calls that move blocks, as methods or functions (a function mode sees the Python call).
_INDEX_COPY = frozenset({torch.Tensor.index_copy_})
_INDEX_SELECT = frozenset({torch.Tensor.index_select, torch.index_select})
_COPY = frozenset({torch.Tensor.copy_})
# The calls an index tensor is built through from a host list, whose values are then known without reading the device.
_FROM_LIST = frozenset({torch.tensor, torch.as_tensor})
_KEEPS_VALUES = frozenset({torch.Tensor.to, torch.Tensor.__getitem__})


_Key = tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...], int]


def _key(t: torch.Tensor) -> _Key:
    # The number of rows is left out: views of one cache may cover its trailing bytes or not.  The shape's tail is a
    # torch.Size (a tuple: it hashes and compares as one) and the strides a tuple already: no copies.
    return (t.untyped_storage().data_ptr(), t.dtype, t.shape[1:], t.stride(), int(t.storage_offset()))


@dataclasses.dataclass(slots=True)  # not frozen (treated as immutable): a frozen initialiser is twice as slow, and
class BlockWrite:  # one is built in the engine's move, timed as the canary's
    """One ``index_copy_`` into a watched view: rows of ``source`` land in blocks ``dest``.

    ``groups`` are the watched views it matches (groups laid over the same bytes with the same block
    size look alike); ``source_blocks`` are the blocks the source rows were gathered from, when the
    source is an ``index_select`` of a watched view seen in the same move, else None.
    """

    groups: tuple[str, ...]
    dest: torch.Tensor
    source_blocks: torch.Tensor | None
    source_host_blocks: tuple[int, ...] | None = None  # a restore: host block of each source row (-1: unknown)
    dest_values: tuple[int, ...] | None = None  # ``dest``'s values where it was built from a host list in the move
    source_values: tuple[int, ...] | None = None  # the same for ``source_blocks``


@dataclasses.dataclass(slots=True)  # not frozen (treated as immutable), as BlockWrite
class HostSave:
    """One copy into the host swap pool: host blocks ``host_blocks`` (of ``groups``' host view) receive the device
    blocks :attr:`source_blocks`: rows ``at ..`` of the gather's index ``gather`` (None: the bytes came from no watched
    gather), sliced each time it is asked (a tensor op, kept out of the engine's move).  The mirror's
    ``_save_batch`` asks up to three times a save, also where every source's values are known; testing ``gather``
    there instead would spare those slices."""

    groups: tuple[str, ...]
    host_blocks: tuple[int, ...]
    gather: torch.Tensor | None
    source_values: tuple[int, ...] | None = None  # the source blocks' values where built from a host list in the move
    at: int = 0

    @property
    def source_blocks(self) -> torch.Tensor | None:
        gather, at, n = self.gather, self.at, len(self.host_blocks)
        if gather is None or (at == 0 and gather.shape[0] == n):
            return gather
        return gather[at : at + n]


def _arg(args: Any, kwargs: Mapping[str, Any] | None, i: int, name: str) -> Any:
    """Argument ``i`` of a call, given by position or by ``name`` (None when absent; ``kwargs`` may be None)."""
    return args[i] if len(args) > i else kwargs.get(name) if kwargs else None


class BlockWriteObserver(TorchFunctionMode):
    """Active only around one engine move: records the block writes into the watched views."""

    def __init__(self, keys: Mapping[_Key, tuple[str, ...]], host_pool: torch.Tensor | None = None) -> None:
        """Watch the block views whose ``keys`` are given (:func:`watch`; kept from move to move by
        :meth:`BlockViews.keys`), and the engine's host swap pool ``host_pool`` when given."""
        super().__init__()
        self._views = keys
        self._gathers: dict[int, tuple[tuple[str, ...], torch.Tensor]] = {}  # index_select result -> its blocks
        self._host = None if host_pool is None else host_pool.untyped_storage().data_ptr()
        self._staged: dict[int, list[int]] = {}  # storage of a staging tensor -> host block of each row
        # id of a 1-d tensor built from a host list in this move (or moved or sliced from one) -> (it, its values)
        self._values: dict[int, tuple[torch.Tensor, tuple[int, ...]]] = {}
        self.writes: list[BlockWrite] = []
        self.host_saves: list[HostSave] = []
        # Host time of the observer's own work in its calls (torch's dispatch into it and the engine's calls left out):
        # the canary's, counted with the mirror's.
        self.own_ns = 0

    def _groups(self, t: Any) -> tuple[str, ...]:
        return self._views.get(_key(t), ()) if isinstance(t, torch.Tensor) else ()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # Every tensor call of the engine's move passes here: no keyword dict is made for a call that has none.
        out = func(*args, **kwargs) if kwargs else func(*args)
        start = time.perf_counter_ns()
        self._note(func, args, kwargs, out)
        self.own_ns += time.perf_counter_ns() - start
        return out

    def _note(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """Keep what ``func(*args, **kwargs) -> out`` tells: the commonest calls (slices, then copies) tested first."""
        if func in _KEEPS_VALUES:
            if self._values:
                self._keep_values(func, args, out)
        elif func in _COPY:
            if self._host is not None:
                self._row_copy(args[0], _arg(args, kwargs, 1, "src"))
        elif func in _INDEX_COPY:
            if _arg(args, kwargs, 1, "dim") == 0 and (groups := self._groups(args[0])):
                source = kwargs["tensor"] if kwargs and "tensor" in kwargs else _arg(args, kwargs, 3, "source")
                self.writes.append(self._block_write(groups, _arg(args, kwargs, 2, "index"), source))
        elif func in _INDEX_SELECT:
            if _arg(args, kwargs, 1, "dim") == 0 and (groups := self._groups(args[0])):
                self._gathers[out.untyped_storage().data_ptr()] = (groups, _arg(args, kwargs, 2, "index"))
        elif func in _FROM_LIST:
            data = _arg(args, kwargs, 0, "data")
            if type(data) is list and isinstance(out, torch.Tensor) and out.dim() == 1:
                self._values[id(out)] = (out, tuple(data))

    def _keep_values(self, func: Any, args: Any, out: Any) -> None:
        """``out`` of a ``to`` or a slice of a tensor whose values are known holds the same (or the sliced) values."""
        kept = self._values.get(id(args[0]))
        if kept is None or kept[0] is not args[0] or not isinstance(out, torch.Tensor):
            return
        if func is torch.Tensor.to:
            self._values[id(out)] = (out, kept[1])
        elif isinstance(args[1], slice) and out.dim() == 1:
            self._values[id(out)] = (out, kept[1][args[1]])

    def values(self, t: torch.Tensor) -> tuple[int, ...] | None:
        """The values of ``t`` where it was built from a host list in this move; None otherwise."""
        kept = self._values.get(id(t))
        return kept[1] if kept is not None and kept[0] is t else None

    def _block_write(self, groups: tuple[str, ...], dest: torch.Tensor, src: torch.Tensor) -> BlockWrite:
        ptr, n = src.untyped_storage().data_ptr(), src.shape[0]
        staged = self._staged.pop(ptr, None)
        if staged is not None:
            first = _row(src)
            rows = staged[first : first + n] if first is not None else []
            hosts = tuple(rows) if len(rows) == n else (-1,) * n
            return BlockWrite(groups, dest, None, hosts, self.values(dest))
        gathered = self._gathers.get(ptr) if src.storage_offset() == 0 else None
        blocks = None if gathered is None or gathered[1].shape[0] != n else gathered[1]
        known = None if blocks is None else self.values(blocks)
        return BlockWrite(groups, dest, blocks, None, self.values(dest), known)

    def _row_copy(self, dst: Any, src: Any) -> None:
        """A ``copy_`` of whole rows into the host pool (offload) or out of it into a staging tensor (restore)."""
        if not (isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor)) or dst.dim() != 2:
            return
        ptr = dst.untyped_storage().data_ptr()
        to_host = ptr == self._host
        if not to_host and src.untyped_storage().data_ptr() != self._host:
            return  # neither end is the swap pool
        dst_row, src_row, n = _row(dst), _row(src), dst.shape[0]
        if dst_row is None or src_row is None:
            return
        if to_host:
            self._host_save(src, src_row, dst_row, n)
            return
        rows = self._staged.get(ptr)
        if rows is None:
            total = dst.untyped_storage().nbytes() // max(dst.stride()[0] * dst.element_size(), 1)
            rows = self._staged[ptr] = [-1] * total
        rows[dst_row : dst_row + n] = range(src_row, src_row + n)

    def _host_save(self, src: torch.Tensor, src_row: int, dst_row: int, n: int) -> None:
        """``n`` host rows from ``dst_row`` receive rows of ``src`` from ``src_row``: blocks of a watched gather, where
        ``src`` is one that covers them."""
        hosts = tuple(range(dst_row, dst_row + n))
        gathered = self._gathers.get(src.untyped_storage().data_ptr())
        if gathered is None:
            self.host_saves.append(HostSave((), hosts, None, None))
            return
        groups, index = gathered
        if src_row + n > index.shape[0]:  # rows past the gather's: their blocks are not known
            self.host_saves.append(HostSave(groups, hosts, None, None))
            return
        known = self.values(index)
        values = None if known is None else known[src_row : src_row + n]
        self.host_saves.append(HostSave(groups, hosts, index, values, src_row))


def _row(t: torch.Tensor) -> int | None:
    """The first row of a row-contiguous 2-d view into its storage, or None when it starts mid-row."""
    stride, offset = t.stride()[0], t.storage_offset()
    if stride <= 0 or offset % stride:
        return None
    return offset // stride


def watch(views: Mapping[str, torch.Tensor]) -> dict[_Key, tuple[str, ...]]:
    """Each view's key -> the groups it stands for (groups over the same bytes and block size share one)."""
    keys: dict[_Key, tuple[str, ...]] = {}
    for name, view in views.items():
        k = _key(view)
        keys[k] = (*keys.get(k, ()), name)
    return keys


_Layout = tuple[int, int, int, torch.dtype, tuple[int, ...], tuple[int, ...], int]


def _layout(allocator: Any) -> _Layout:
    """What an allocator's block view (and so its key) is built from: host attributes of its cache tensor."""
    t = allocator.cache_tensor
    return (
        id(t),
        t.data_ptr(),
        t.storage_offset(),
        t.dtype,
        tuple(t.shape),
        t.stride(),
        int(allocator.bytes_per_block),
    )


class BlockViews:
    """The keys of allocators' block views (:func:`block_view`, :func:`watch`), kept from move to move.

    Building them was a few tensor calls an allocator every move, though they change only with the cache tensor.
    Each move compares the cache tensor's object, address, offset, dtype, shape and stride and the block size (host
    attributes, no tensor op) and rebuilds on any change; the key is a function of these alone, so an ``id`` reused
    by a new tensor of the same layout gets the right key too.  Only host values are kept, no tensor: a cache the engine
    replaced is not held alive.  Kept per set of group names (the fork copy watches one, offload and restore all).
    """

    def __init__(self) -> None:
        self._kept: dict[tuple[str, ...], tuple[tuple[_Layout, ...], dict[_Key, tuple[str, ...]]]] = {}

    def keys(self, allocators: Mapping[str, Any]) -> Mapping[_Key, tuple[str, ...]]:
        """The watched keys of ``allocators`` (group -> allocator), for :class:`BlockWriteObserver`."""
        names, layouts = tuple(allocators), tuple(_layout(a) for a in allocators.values())
        kept = self._kept.get(names)
        if kept is None or kept[0] != layouts:
            kept = self._kept[names] = (layouts, watch({n: block_view(a) for n, a in allocators.items()}))
        return kept[1]


def block_view(allocator: Any) -> torch.Tensor:
    """The allocator's cache bytes as ``[blocks, bytes_per_block]`` (the view the engine copies blocks in),
    built from its cache tensor so that a view the engine swapped in is not mistaken for the cache."""
    flat: torch.Tensor = allocator.cache_tensor.view(-1).view(torch.uint8)
    return flat.view(-1, int(allocator.bytes_per_block))
