"""Watch where the engine's bulk KV moves actually write, so the records follow the bytes.

The engine moves KV without a forward (fork copies, CPU-offload restores) by writing whole blocks into
its cache tensor viewed as ``[blocks, bytes_per_block]``.  Mirroring the engine's *bookkeeping* (the
arguments of ``copy_blocks``, the request's block table after a restore) would move the records where
the bytes should be; a bug that sends the bytes elsewhere (a copy that never lands, a restore into the
wrong block) would then leave records and reads in agreement over misplaced bytes.  So while such a move
runs, a dispatch mode sees every tensor op and keeps the ones that write into a watched block view: the
records are then moved to exactly those destinations.  Ops run as they would anyway (no extra device
work, no host sync); only the index tensors are kept.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten


_Key = tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...], int]


def _key(t: torch.Tensor) -> _Key:
    # The number of rows is left out: views of one cache may cover its trailing bytes or not.
    return (t.untyped_storage().data_ptr(), t.dtype, tuple(t.shape[1:]), tuple(t.stride()), int(t.storage_offset()))


@dataclasses.dataclass(frozen=True)
class BlockWrite:
    """One ``index_copy_`` into a watched view: rows of ``source`` land in blocks ``dest``.

    ``groups`` are the watched views it matches (groups laid over the same bytes with the same block
    size look alike); ``source_blocks`` are the blocks the source rows were gathered from, when the
    source is an ``index_select`` of a watched view seen in the same move, else None.
    """

    groups: tuple[str, ...]
    dest: torch.Tensor
    source_blocks: torch.Tensor | None


class BlockWriteObserver(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's mode is untyped
    """Active only around one engine move: records the block writes into the watched views."""

    def __init__(self, views: Mapping[str, torch.Tensor]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._views: dict[_Key, tuple[str, ...]] = {}
        for name, view in views.items():
            k = _key(view)
            self._views[k] = (*self._views.get(k, ()), name)
        self._gathers: dict[int, torch.Tensor] = {}  # storage of an index_select's result -> its source blocks
        self.writes: list[BlockWrite] = []

    def _groups(self, t: Any) -> tuple[str, ...]:
        return self._views.get(_key(t), ()) if isinstance(t, torch.Tensor) else ()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is _aten.index_copy_.default and args[1] == 0:
            groups = self._groups(args[0])
            if groups:
                src = args[3]
                gathered = self._gathers.get(src.untyped_storage().data_ptr()) if src.storage_offset() == 0 else None
                if gathered is not None and int(gathered.shape[0]) != int(src.shape[0]):
                    gathered = None
                self.writes.append(BlockWrite(groups, args[2], gathered))
        elif func is _aten.index_select.default and args[1] == 0 and self._groups(args[0]):
            self._gathers[out.untyped_storage().data_ptr()] = args[2]
        return out


def block_view(allocator: Any) -> torch.Tensor:
    """The allocator's cache bytes as ``[blocks, bytes_per_block]`` (the view the engine copies blocks in),
    built from its cache tensor so that a view the engine swapped in is not mistaken for the cache."""
    flat: torch.Tensor = allocator.cache_tensor.view(-1).view(torch.uint8)
    return flat.view(-1, int(allocator.bytes_per_block))
