"""The fault library, in the order the matrix lists it."""

from __future__ import annotations

import types
from collections.abc import Mapping

from kvcanary.adapters.transformers_cb.selftest.allocator import DoubleFree, UseAfterFree
from kvcanary.adapters.transformers_cb.selftest.context import TransformersFault
from kvcanary.adapters.transformers_cb.selftest.copies import (
    ForkCopyLost,
    ForkSkipCopy,
    OffloadRestoreLost,
    OffloadRestoreWrongBlock,
    OffloadRestoreWrongHostBlock,
)
from kvcanary.adapters.transformers_cb.selftest.data import (
    ForkCopyCorruptsBytes,
    KVBitFlip,
    OffloadRestoreStaleBytes,
    PaddingWriteLiveSlot,
)
from kvcanary.adapters.transformers_cb.selftest.index import (
    ChunkBoundaryPosition,
    DroppedWrite,
    SlotMappingForeign,
    WindowRingOffByOne,
    WriteIntoLiveSlot,
    WrongTokenId,
)
from kvcanary.adapters.transformers_cb.selftest.prefix import StalePrefixHit
from kvcanary.adapters.transformers_cb.selftest.rollback import RollbackKeepsDraft

_ALL: tuple[type[TransformersFault], ...] = (
    SlotMappingForeign,
    StalePrefixHit,
    UseAfterFree,
    DoubleFree,
    ChunkBoundaryPosition,
    DroppedWrite,
    WriteIntoLiveSlot,
    RollbackKeepsDraft,
    WindowRingOffByOne,
    ForkSkipCopy,
    ForkCopyLost,
    OffloadRestoreLost,
    OffloadRestoreWrongBlock,
    OffloadRestoreWrongHostBlock,
    WrongTokenId,
    KVBitFlip,
    PaddingWriteLiveSlot,
    ForkCopyCorruptsBytes,
    OffloadRestoreStaleBytes,
)

FAULTS: Mapping[str, type[TransformersFault]] = types.MappingProxyType({f.spec.name: f for f in _ALL})
