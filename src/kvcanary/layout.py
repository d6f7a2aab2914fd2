"""Canary groups (one KV index space each) and the per-slot record store."""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Sequence
from typing import cast

import torch

from kvcanary.arguments import require_enum, require_int, require_int_tuple

# Whole blocks of a move: an int64 index on the records' device, or a run of consecutive blocks as a slice, which
# selects them as a view: no index to build and send, no gather (a host pool's blocks often come in runs).
Blocks = torch.Tensor | slice


class GroupKind(enum.Enum):
    FULL = "full"
    SLIDING_WINDOW = "sliding_window"


_FROM_WINDOW = cast(GroupKind, None)  # CanaryGroup.kind not given: SLIDING_WINDOW when window > 0, else FULL


@dataclasses.dataclass(frozen=True)
class CanaryGroup:
    """One KV index space and how a request's table maps onto it.

    ``page_size`` 1 means the table holds slots (a token table); larger means it holds blocks and
    ``slot = table[row, pos // page_size] * page_size + pos % page_size``.  A sliding-window group
    verifies only the last ``window`` positions of each prefix (``kind`` follows from ``window`` when it is
    not given; given, it must agree); when ``uses_lookup`` is set, table
    entries are full-pool slots translated through a full->window lookup table handed in with each
    batch.  ``token_offset`` is 1 for a speculative-draft pool, whose KV at position p holds the
    token of position p + 1.  ``reserved_slots`` (padding, trash, sentinel) must never hold a live
    token.  ``padding_row`` is the table row of padding batch rows (sglang's row 0), or None.
    ``checks_new_reads``: the table also holds the entries of the step's own tokens (positions
    ``[prefix_len, prefix_len + extend_len)``), so stamp checks each against the slot the token writes.
    """

    num_slots: int
    group_id: int = 0
    name: str = "full"
    kind: GroupKind = _FROM_WINDOW
    window: int = 0
    uses_lookup: bool = False
    page_size: int = 1
    token_offset: int = 0
    reserved_slots: tuple[int, ...] = (0,)
    padding_row: int | None = 0
    checks_new_reads: bool = True

    MAX_RESERVED = 8

    def __post_init__(self) -> None:
        for name in ("num_slots", "group_id", "window", "page_size", "token_offset"):
            require_int(name, getattr(self, name))
        if self.kind is _FROM_WINDOW:
            derived = GroupKind.SLIDING_WINDOW if self.window > 0 else GroupKind.FULL
            object.__setattr__(self, "kind", derived)
        require_enum("kind", self.kind, GroupKind)
        require_int_tuple("reserved_slots", self.reserved_slots)
        if self.padding_row is not None:
            require_int("padding_row", self.padding_row)
        if self.num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {self.num_slots}")
        if not 0 <= self.group_id < 2**31:
            raise ValueError(f"group_id must be in [0, 2**31), got {self.group_id}")
        if self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        if self.kind is GroupKind.FULL and (self.window != 0 or self.uses_lookup):
            raise ValueError("a FULL group takes no window and no lookup table")
        if self.kind is GroupKind.SLIDING_WINDOW and self.window <= 0:
            raise ValueError(f"a SLIDING_WINDOW group needs window > 0, got {self.window}")
        if self.token_offset not in (0, 1):
            raise ValueError(f"token_offset must be 0 (target) or 1 (draft), got {self.token_offset}")
        if len(self.reserved_slots) > self.MAX_RESERVED:
            raise ValueError(f"at most {self.MAX_RESERVED} reserved_slots, got {len(self.reserved_slots)}")
        for s in self.reserved_slots:
            if not 0 <= s < self.num_slots:
                raise ValueError(f"reserved slot {s} is outside the pool [0, {self.num_slots})")
        if self.padding_row is not None and self.padding_row < 0:
            raise ValueError(f"padding_row must be >= 0 or None, got {self.padding_row}")


_ROW_ALIGN = 32  # int32 elements: 128 bytes


@dataclasses.dataclass
class RecordStore:
    """Per-slot records: token (int32), position (int32), link (int64): 16 bytes a slot.

    Structure of arrays so that kernels load each field coalesced.  A link of 0 means "never
    written"; no written record can hold it (see :mod:`kvcanary.hashing`).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    links: torch.Tensor
    # The KV digest (kvcanary.digest), when enabled: int64, 0 = never digested.  It travels with the record.
    digests: torch.Tensor | None = None

    # The fields as [k, blocks, page] by page size and jointness (see :meth:`blocks`): built once, not per move.
    _block_views: dict[tuple[int, bool], tuple[torch.Tensor, ...]] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    # Where the positions start past the tokens (in elements) when both are contiguous rows of one tensor, as
    # allocate lays them out, else 0.  The fields are set once (the views above assume it too): asked on every move,
    # so found once.
    _row_gap: int = dataclasses.field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        t, p = self.tokens, self.positions
        gap = int(p.storage_offset() - t.storage_offset())
        same = p.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
        one_dim = t.dim() == p.dim() == 1 and t.shape == p.shape
        if same and one_dim and t.dtype == p.dtype and t.is_contiguous() and p.is_contiguous() and gap >= t.shape[0]:
            self._row_gap = gap

    BYTES_PER_SLOT = 16  # int32 token + int32 position + int64 link
    DIGEST_BYTES_PER_SLOT = 8

    @classmethod
    def allocate(cls, num_slots: int, device: torch.device | str = "cpu") -> RecordStore:
        # Tokens and positions are the two rows of one tensor (each row contiguous, as the kernels load it): a block
        # move then gathers and writes both with one op each (see :meth:`blocks`).  The rows start at 128-byte
        # boundaries, as separate allocations would: the kernels specialise their pointers on alignment.
        pair = torch.zeros(2, _row_stride(num_slots), dtype=torch.int32, device=device)
        return cls(pair[0, :num_slots], pair[1, :num_slots], torch.zeros(num_slots, dtype=torch.int64, device=device))

    @property
    def num_slots(self) -> int:
        return int(self.links.shape[0])

    @property
    def device(self) -> torch.device:
        return self.links.device

    def fields(self) -> tuple[torch.Tensor, ...]:
        """Every per-slot tensor: token, position, link, and the digest when enabled."""
        fields = (self.tokens, self.positions, self.links)
        return fields if self.digests is None else (*fields, self.digests)

    def bytes_per_slot(self) -> int:
        return sum(t.element_size() for t in self.fields())

    def enable_digests(self) -> None:
        """Allocate the per-slot digests (8 bytes a slot), all 0 (never digested)."""
        if self.digests is None:
            self.digests = torch.zeros(self.num_slots, dtype=torch.int64, device=self.device)
            self._block_views.clear()

    def clear_slots(self, slots: torch.Tensor) -> None:
        for t in self.fields():
            t[slots] = 0

    def blocks(self, page: int, joint: bool = True) -> tuple[torch.Tensor, ...]:
        """Every field (:meth:`fields`) viewed as ``[k, blocks, page]``, blocks along dimension 1: the slots of whole
        blocks of ``page`` slots (slots past the last whole block, the reserved ones, are left out).  With ``joint``,
        the tokens and positions are one view of ``k = 2`` where :meth:`allocate` laid them out as the rows of one
        tensor; every other field is a view of ``k = 1``."""
        views = self._block_views.get((page, joint))
        if views is None:
            whole = self.num_slots - self.num_slots % page
            rows = [t.unsqueeze(0) for t in self.fields()]
            if joint and self._row_gap:
                rows[:2] = [self.tokens.as_strided((2, self.num_slots), (self._row_gap, 1))]
            views = self._block_views[page, joint] = tuple(r[:, :whole].view(r.shape[0], -1, page) for r in rows)
        return views

    def copy_blocks(self, src: Blocks, dst: Blocks, page: int, source: RecordStore | None = None) -> None:
        """Mirror an engine's copy of whole blocks: the records of blocks ``src`` (of ``source``, default this store)
        into blocks ``dst`` of this store (see :data:`Blocks`; a run only where ``source`` is another store).  One
        gather and one write per :meth:`blocks` view (the tokens and positions share one; a run of ``src`` is a view,
        no gather): a move of the GPU demo's made sixteen device ops per group through per-slot indices, the engine's
        moves the largest share of the canary's host time on the hybrid model."""
        source = source or self
        joint = bool(self._row_gap) == bool(source._row_gap)  # laid out alike: the joint views line up
        for to, of in zip(self.blocks(page, joint), source.blocks(page, joint), strict=True):
            _put(to, dst, _take(of, src))

    def clear_blocks(self, blocks: Blocks, page: int) -> None:
        """No record in whole blocks ``blocks``: their bytes come from nowhere the canary knows."""
        for t in self.blocks(page):
            _clear(t, blocks)

    def clone(self) -> RecordStore:
        """A copy laid out as :meth:`allocate` lays a store out (tokens and positions joint), whatever this one's."""
        out = RecordStore.allocate(self.num_slots, self.device)
        for dst, src in zip(out.fields(), self.fields(), strict=False):
            dst.copy_(src)
        out.digests = None if self.digests is None else self.digests.clone()
        return out


class RecordRows:
    """The records of several groups of one slot count as the rows of two tensors: group ``g``'s tokens and positions
    are rows ``2g`` and ``2g + 1`` of one int32 tensor, its links row ``g`` of one int64 tensor (:meth:`allocate`).

    Each group's :class:`RecordStore` views its own rows, so the kernels see what they always see.  Groups laid over
    one engine cache tensor see each block move land in all of them alike (the transformers hybrid model's two);
    mirrored per group, a move cost one gather and one write per field view and group, and as rows of one tensor it
    costs one each per tensor for all the groups (:meth:`copy_blocks`).  Digests are per store: rows of stores with
    digests are not joined (:meth:`of`)."""

    def __init__(self, pairs: torch.Tensor, links: torch.Tensor) -> None:
        if pairs.shape[0] != 2 * links.shape[0] or pairs.shape[1] != links.shape[1]:
            raise ValueError(f"pairs {tuple(pairs.shape)} must hold two rows for each of links {tuple(links.shape)}")
        self.pairs, self.links = pairs, links
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # by page size: built once

    @classmethod
    def allocate(cls, num_slots: int, groups: int, device: torch.device | str = "cpu") -> RecordRows:
        """Zeroed rows for ``groups`` stores of ``num_slots`` slots, each row at a 128-byte boundary (as
        :meth:`RecordStore.allocate` lays one store out)."""
        stride = _row_stride(num_slots)
        pairs = torch.zeros(2 * groups, stride, dtype=torch.int32, device=device)
        links = torch.zeros(groups, stride, dtype=torch.int64, device=device)
        return cls(pairs[:, :num_slots], links[:, :num_slots])

    @classmethod
    def of(cls, stores: Sequence[RecordStore]) -> RecordRows | None:
        """The rows ``stores`` are, in this order, when they are consecutive rows laid out as :meth:`allocate` lays
        them and none carries digests; else None (mirror them one by one)."""
        if not stores or any(s.digests is not None or not s._row_gap for s in stores):
            return None
        first = stores[0]
        storages = {(s.tokens.untyped_storage().data_ptr(), s.links.untyped_storage().data_ptr()) for s in stores}
        links_stride = _link_stride(stores)
        if len(storages) != 1 or links_stride is None:
            return None
        n, slots, row = len(stores), first.num_slots, first._row_gap
        try:
            pairs = first.tokens.as_strided((2 * n, slots), (row, 1))
            links = first.links.as_strided((n, slots), (links_stride, 1))
        except RuntimeError:  # past the end of the allocation
            return None
        for g, s in enumerate(stores):
            at = (s.tokens.data_ptr(), s.links.data_ptr()) == (pairs[2 * g].data_ptr(), links[g].data_ptr())
            if not at or (s.num_slots, s._row_gap) != (slots, row):
                return None
        return cls(pairs, links)

    @property
    def num_slots(self) -> int:
        return int(self.links.shape[1])

    @property
    def device(self) -> torch.device:
        return self.links.device

    def stores(self) -> list[RecordStore]:
        """Each group's store: views of its rows."""
        return [RecordStore(self.pairs[2 * g], self.pairs[2 * g + 1], self.links[g]) for g in range(len(self.links))]

    def blocks(self, page: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Both tensors as ``[rows, blocks, page]`` over the slots of whole blocks (see :meth:`RecordStore.blocks`)."""
        views = self._views.get(page)
        if views is None:
            whole = self.num_slots - self.num_slots % page
            pairs, links = (t[:, :whole].view(t.shape[0], -1, page) for t in (self.pairs, self.links))
            views = self._views[page] = (pairs, links)
        return views

    def copy_blocks(self, src: Blocks, dst: Blocks, page: int, source: RecordRows | None = None) -> None:
        """:meth:`RecordStore.copy_blocks` for every group at once (``source``: rows of as many groups)."""
        source = source or self
        for to, of in zip(self.blocks(page), source.blocks(page), strict=True):
            _put(to, dst, _take(of, src))

    def clear_blocks(self, blocks: Blocks, page: int) -> None:
        """:meth:`RecordStore.clear_blocks` for every group at once."""
        for t in self.blocks(page):
            _clear(t, blocks)


def _row_stride(num_slots: int) -> int:
    """Elements from one record row to the next: ``num_slots`` rounded up so that every row starts at a 128-byte
    boundary (the kernels specialise their pointers on alignment)."""
    return -(-num_slots // _ROW_ALIGN) * _ROW_ALIGN


def _link_stride(stores: Sequence[RecordStore]) -> int | None:
    """The distance between consecutive stores' links (elements), the same for all; None when it is not."""
    if len(stores) == 1:
        return int(stores[0].links.shape[0])
    gaps = {b.links.data_ptr() - a.links.data_ptr() for a, b in itertools.pairwise(stores)}
    size = stores[0].links.element_size()
    if len(gaps) != 1 or (gap := gaps.pop()) <= 0 or gap % size or gap // size < stores[0].num_slots:
        return None
    return gap // size


def block_run(blocks: Sequence[int]) -> slice | None:
    """``blocks`` as a slice when they are consecutive and ascending (and not negative), else None."""
    if not blocks or blocks[0] < 0:
        return None
    first, n = blocks[0], len(blocks)
    return slice(first, first + n) if tuple(blocks) == tuple(range(first, first + n)) else None


def _take(view: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """Blocks along dimension 1 of ``view``: a view of a run, a gather of an index."""
    return view[:, blocks] if isinstance(blocks, slice) else view.index_select(1, blocks)


def _put(view: torch.Tensor, blocks: Blocks, values: torch.Tensor) -> None:
    if isinstance(blocks, slice):
        view[:, blocks] = values  # a run past the view's end is a shape mismatch, refused as an index past it
    else:
        view.index_copy_(1, blocks, values)


def _clear(view: torch.Tensor, blocks: Blocks) -> None:
    if isinstance(blocks, slice):
        view[:, blocks] = 0
    else:
        view.index_fill_(1, blocks, 0)


def block_index(blocks: Sequence[int], device: torch.device) -> torch.Tensor:
    """Host block numbers as the int64 index that :meth:`RecordStore.copy_blocks` and
    :meth:`RecordStore.clear_blocks` take, on ``device``, without waiting for it.  A tensor built from a list
    straight onto CUDA is a synchronous copy from pageable memory: it waits for every kernel queued before it,
    the engine's forward too (the hybrid GPU demo made 486 such copies a run before the transformers adapter's
    mirror went through here).  Through pinned memory the copy is queued on the stream like the work after it."""
    if device.type != "cuda":
        return torch.tensor(list(blocks), dtype=torch.int64, device=device)
    return torch.tensor(list(blocks), dtype=torch.int64, pin_memory=True).to(device, non_blocking=True)
