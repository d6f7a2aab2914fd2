"""The engine's observed moves as entries of a :class:`~.queued_moves.QueuedMoves`, with the meaning the mirror at once
gives them (:mod:`.mirror`), or None where an entry cannot say it (the caller then mirrors the move at once).

* a block write of device blocks (a fork copy, a restore gathered on the device): each written block gets the
  records of the block its bytes were gathered from, or none where they came from no watched gather;
* an offload's saves: each host block gets the records of the device block its bytes came from, or none;
* a restore's writes from the host pool: each written block gets the records of the host block it was read from;
  none for the whole write where a host block is unknown (-1) or past the host records, or there are none yet.

Entries need the blocks' values on the host (the observer knows them where the engine built its index from a host
list: the usual case) and blocks inside the records of their side; else None.
"""

from __future__ import annotations

import array
from collections.abc import Sequence

from kvcanary.adapters.transformers_cb.byte_moves import BlockWrite, HostSave
from kvcanary.adapters.transformers_cb.queued_moves import FROM_HOST, TO_HOST, QueuedMoves


def fork_entries(q: QueuedMoves, forks: Sequence[tuple[str, BlockWrite]]) -> array.array[int] | None:
    """Block copies (group, observed write), in the order they ran."""
    out: array.array[int] = array.array("q")
    for name, write in forks:
        bits = q.bits.get(name)
        if bits is None or not _device_write(q, write, bits, out):
            return None
    return out


def save_entries(q: QueuedMoves, saves: Sequence[HostSave]) -> array.array[int] | None:
    """One offload's copies into the host pool (the host records attached: :meth:`QueuedMoves.attach`)."""
    out: array.array[int] = array.array("q")
    for save in saves:
        bits = _bits(q, save.groups)
        hosts = save.host_blocks
        if bits is None or not _within(hosts, q.host_blocks):
            return None
        if save.gather is None:
            sources: Sequence[int] = (-1,) * len(hosts)
        else:
            known = save.source_values
            if known is None or len(known) != len(hosts) or not _within(known, q.device_blocks):
                return None
            sources = known
        _add(out, sources, hosts, TO_HOST | bits)
    return out


def restore_entries(q: QueuedMoves, writes: Sequence[BlockWrite]) -> array.array[int] | None:
    """One restore's writes, in the order they ran: from the host pool, or gathered on the device."""
    out: array.array[int] = array.array("q")
    for write in writes:
        bits = _bits(q, write.groups)
        if bits is None:
            return None
        hosts = write.source_host_blocks
        if hosts is None:
            if not _device_write(q, write, bits, out):
                return None
            continue
        dest = write.dest_values
        if dest is None or not _within(dest, q.device_blocks):
            return None
        if q.host is None or not hosts or min(hosts) < 0 or max(hosts) >= q.host_blocks:
            _add(out, (-1,) * len(dest), dest, bits)  # read from no host block the records know: no record
        elif len(hosts) == len(dest):
            _add(out, hosts, dest, FROM_HOST | bits)
        else:
            return None
    return out


def _device_write(q: QueuedMoves, write: BlockWrite, bits: int, out: array.array[int]) -> bool:
    dest = write.dest_values
    if dest is None or not _within(dest, q.device_blocks):
        return False
    if write.source_blocks is None:
        _add(out, (-1,) * len(dest), dest, bits)
        return True
    sources = write.source_values
    if sources is None or len(sources) != len(dest) or not _within(sources, q.device_blocks):
        return False
    _add(out, sources, dest, bits)
    return True


def _bits(q: QueuedMoves, groups: Sequence[str]) -> int | None:
    """The flag bits of ``groups``; None where one is not the queue's."""
    bits = 0
    for name in groups:
        bit = q.bits.get(name)
        if bit is None:
            return None
        bits |= bit
    return bits or None


def _within(blocks: Sequence[int], limit: int) -> bool:
    return not blocks or (min(blocks) >= 0 and max(blocks) < limit)


def _add(out: array.array[int], sources: Sequence[int], dests: Sequence[int], flags: int) -> None:
    for s, d in zip(sources, dests, strict=True):
        out.extend((s, d, flags))
