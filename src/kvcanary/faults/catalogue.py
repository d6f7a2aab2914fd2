"""The fault library, in the order the matrix lists it."""

from __future__ import annotations

import types
from collections.abc import Mapping

from kvcanary.faults.allocator import DoubleFree, UseAfterFree
from kvcanary.faults.base import Fault
from kvcanary.faults.copies import (
    ForkCopyLost,
    ForkSkipCopy,
    OffloadRestoreLost,
    OffloadRestoreWrongBlock,
    OffloadRestoreWrongHostBlock,
)
from kvcanary.faults.data import ForkCopyCorruptsBytes, KVBitFlip, OffloadRestoreStaleBytes, PaddingWriteLiveSlot
from kvcanary.faults.index import (
    ChunkBoundaryPosition,
    DroppedWrite,
    SlotMappingForeign,
    WindowRingOffByOne,
    WriteIntoLiveSlot,
    WrongTokenId,
)
from kvcanary.faults.prefix import StalePrefixHit
from kvcanary.faults.rollback import RollbackKeepsDraft

_ALL: tuple[type[Fault], ...] = (
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

FAULTS: Mapping[str, type[Fault]] = types.MappingProxyType({f.spec.name: f for f in _ALL})
