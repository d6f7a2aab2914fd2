"""One allocator group's index space, mapped compactly onto canary slots.

transformers views the flat cache tensor per group as rows of K/V with per-layer shifted views, so one
physical index ``block * stride + offset`` (``stride = 2 * page * layers_in_group``) addresses token
``offset`` of ``block`` in every layer of the group; offsets ``>= page`` would land in another layer's
page.  Canary slots drop that stride: ``slot = block * page + offset``.  Indices that address no token
(negative, past the cache, or an offset outside the page) map to :attr:`GroupGeometry.invalid_slot`, one
past the pool, so the canary reports them as out of range instead of reading anything.

Special indices: the read trash (0) maps to slot 0 and the write trash to its own block's slot; the
sentinel (1, "put the new token's K/V here" in sliding reads) gets a slot of its own past the blocks,
because with page size 1 it would otherwise alias another layer's row.  All three are reserved.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from kvcanary.layout import CanaryGroup, GroupKind

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclasses.dataclass(frozen=True)
class GroupGeometry:
    name: str  # the allocator's layer type, the key of cu_seq_lens_k
    index: int  # the allocator's index into read_index / write_index
    sliding_window: int  # W for a sliding group, 0 for a full one
    page_size: int
    stride: int  # block_physical_stride
    num_blocks: int  # blocks of this group's view of the whole tensor, trash sectors included
    read_trash_index: int
    sentinel_index: int
    write_trash_index: int

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.stride < self.page_size or self.num_blocks <= 0:
            raise ValueError(
                f"group {self.name!r}: bad geometry page_size={self.page_size} stride={self.stride} "
                f"num_blocks={self.num_blocks}"
            )
        if self.sliding_window == 1:
            # The ring then holds no past token: nothing is read, and the canary's window would be 0.
            raise ValueError(f"group {self.name!r}: sliding_window=1 is not supported (no past token is read)")

    @classmethod
    def from_allocator(cls, allocator: Any, num_sectors: int) -> GroupGeometry:
        """Read the geometry of a transformers ``CacheAllocator`` bound to a cache of ``num_sectors`` sectors."""
        window = int(getattr(allocator, "sliding_window", 0) or 0) if allocator.layer_type == SLIDING_ATTENTION else 0
        return cls(
            name=str(allocator.layer_type),
            index=int(allocator.index),
            sliding_window=window,
            page_size=int(allocator.tokens_per_page),
            stride=int(allocator.block_physical_stride),
            num_blocks=int(allocator.blocks_per_sector) * (int(num_sectors) + 2),  # + the two trash sectors
            read_trash_index=int(allocator.read_trash_index),
            sentinel_index=int(allocator.sentinel_index),
            write_trash_index=int(allocator.write_trash_index),
        )

    @property
    def is_sliding(self) -> bool:
        return self.sliding_window > 0

    @property
    def canary_window(self) -> int:
        """Past tokens attention reads: ``W - 1`` for a ring of ``W`` (the new token is the W-th)."""
        return self.sliding_window - 1 if self.is_sliding else 0

    @property
    def sentinel_slot(self) -> int:
        return self.num_blocks * self.page_size

    @property
    def num_slots(self) -> int:
        return self.sentinel_slot + 1

    @property
    def invalid_slot(self) -> int:
        return self.num_slots

    def _compact(self, index: int) -> int:
        block, offset = divmod(index, self.stride)
        return block * self.page_size + offset

    @property
    def read_trash_slot(self) -> int:
        return self._compact(self.read_trash_index)

    @property
    def write_trash_slot(self) -> int:
        return self._compact(self.write_trash_index)

    @functools.cached_property
    def slot_map(self) -> tuple[int, int, int, int, int, int, int, int]:
        """What :meth:`to_slots` and the special slots need, computed once (the translation kernel's arguments):
        stride, page size, pool end, sentinel index, sentinel slot, invalid slot, read-trash slot, write-trash
        index."""
        return (
            self.stride, self.page_size, self.num_blocks * self.stride, self.sentinel_index, self.sentinel_slot,
            self.invalid_slot, self.read_trash_slot, self.write_trash_index,
        )  # fmt: skip

    def canary_group(self, group_id: int) -> CanaryGroup:
        return CanaryGroup(
            num_slots=self.num_slots,
            group_id=group_id,
            name=self.name,
            kind=GroupKind.SLIDING_WINDOW if self.is_sliding else GroupKind.FULL,
            window=self.canary_window,
            page_size=1,  # the adapter's table is a token table filled from the read indices
            reserved_slots=tuple(sorted({self.read_trash_slot, self.write_trash_slot, self.sentinel_slot})),
            padding_row=0,  # checks_new_reads: the table holds the step's own tokens' read entries too
        )

    def to_slots(self, index: torch.Tensor) -> torch.Tensor:
        """Physical indices (any int dtype) -> canary slots (int64); see the module docstring."""
        # Few ops on purpose (each is a kernel launch per step on GPU): alpha folds the multiplies, and
        # 0 <= idx < num_blocks * stride is one clamp-and-compare.
        idx = index.long()
        block = torch.div(idx, self.stride, rounding_mode="floor")
        offset = torch.sub(idx, block, alpha=self.stride)
        in_pool = idx.clamp(0, self.num_blocks * self.stride - 1) == idx
        valid = in_pool & (offset < self.page_size)
        slots = torch.where(valid, torch.add(offset, block, alpha=self.page_size), self.invalid_slot)
        return slots.masked_fill_(idx == self.sentinel_index, self.sentinel_slot)

    def block_slots(self, block_ids: torch.Tensor) -> torch.Tensor:
        """Canary slots of whole blocks, block after block (for mirroring block copies)."""
        ids = block_ids.long().reshape(-1, 1)
        return (ids * self.page_size + torch.arange(self.page_size, device=ids.device)).reshape(-1)
