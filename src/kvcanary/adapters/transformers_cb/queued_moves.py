"""The engine's block moves queued as entries and applied by the next step's own device work, not one by one.

Mirrored as it happens, each fork copy, offload or restore cost a dozen torch calls and index builds of host time,
tens of microseconds each with the caches cold (on the GPU demo's hybrid model about 0.2 ms a move).  Where the
staging is slotted (its step work reads pinned slot ``k % NUM_SLOTS`` for host step ``k``, see :mod:`.staging`), a
move instead writes one entry a moved block into this queue's own pinned slot for the step about to run, and the
record-move kernel (``ops/kernels/record_moves.py``) applies the entries in order inside the canary's step graph,
before the step's verify reads the records.  The kernel is in every step's prelude, so a step with moves replays the
graph of its shape class; a slot with no entries costs it one read.  (Only steps with moves had it at first: each shape
class was then captured twice, about 2 ms a capture on an H100.)  Between two steps nothing but the canary reads the
records, and the entries keep the moves' order, so the records end as the moves one by one would leave them.  The
host pool's records are attached when the binding is made (:func:`.bulk_moves.attach_host_rows`), so the launch is
built once.

A move this queue cannot express (an index whose values the host does not know, a host block past the host rows,
records that are not rows of one tensor pair) is mirrored at once as before, after the entries queued so far are
applied at once (:meth:`QueuedMoves.apply_now`, through :func:`apply_entries`, the kernel's torch spec): the order
holds either way.
"""

from __future__ import annotations

import array
import dataclasses
from collections.abc import Sequence

import torch

from kvcanary.adapters.transformers_cb.staging import HEAD_WORDS, NUM_SLOTS
from kvcanary.adapters.transformers_cb.translate_kernel import Launches
from kvcanary.layout import RecordRows
from kvcanary.runtime.pump import CopyFence

ENTRY_WORDS = 3  # source block (-1: none), destination block, flags
CAPACITY = 1024  # entries a step; past it the queued ones are applied at once
FROM_HOST = 1  # flag: the source block is the host pool's
TO_HOST = 2  # flag: the destination block is the host pool's
GROUP_SHIFT = 8  # flag bit GROUP_SHIFT + g: the move lands in group g
_MAX_PRELUDES = 64  # preludes kept with the moves' launch added (steady steps hand the same ones again)


@dataclasses.dataclass
class MoveCounts:
    """What the queues of one install did (the adapter's stats): entries queued, the steps whose work applied some,
    and entries applied at once instead (a move the queue could not express, or a full slot)."""

    queued_move_entries: int = 0
    steps_with_queued_moves: int = 0
    move_entries_applied_at_once: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class QueuedMoves:
    """The queue of one binding: its pinned slots, the device records as rows (``rows``, groups ``names`` in row
    order) and, once the first offload made them, the host pool's records as rows of the same groups (:meth:`attach`).
    ``fence``: the slotted staging's, whose ``next_step`` names the slot and whose ``seq`` the kernel reads."""

    def __init__(
        self, rows: RecordRows, names: tuple[str, ...], page: int, fence: CopyFence, counts: MoveCounts | None = None
    ) -> None:
        if fence.seq is None:
            raise ValueError("queued moves need a publishing fence (its seq names the slot the step work reads)")
        if len(names) != len(rows.links):
            raise ValueError(f"{len(names)} group names for {len(rows.links)} record rows")
        if len(names) > 62 - GROUP_SHIFT:
            raise ValueError(f"{len(names)} groups: an entry's flags name at most {62 - GROUP_SHIFT}")
        self.rows, self.names, self.page = rows, names, page
        self.bits = {n: 1 << (GROUP_SHIFT + g) for g, n in enumerate(names)}
        self.device_blocks = rows.num_slots // page
        self.host: RecordRows | None = None
        self.host_blocks = 0
        self._fence = fence
        self._seq = fence.seq
        pinned = rows.device.type == "cuda"
        words = HEAD_WORDS + CAPACITY * ENTRY_WORDS
        self._slots = torch.zeros((NUM_SLOTS, words), dtype=torch.int64, pin_memory=pinned)
        self._slot_words = [self._slots[i].numpy().data.cast("B").cast("q") for i in range(NUM_SLOTS)]
        self.count = 0  # entries queued for host step ``self._step``
        self._step = -1
        self._launch = RecordMovesLaunch(self._slots, self._seq, rows, None, page)
        self._with: dict[int, tuple[Launches | None, Launches]] = {}
        self.counts = MoveCounts() if counts is None else counts

    def attach(self, host: RecordRows) -> None:
        """The host pool's records (rows of :attr:`names`): host entries read and write them from now on.  Rows that
        replace others first apply the entries queued so far (they may name the rows replaced); before any, no entry
        names the host's."""
        if host is self.host:
            return
        if len(host.links) != len(self.names) or host.device != self.rows.device:
            raise ValueError("the host records must be rows of the same groups, on the records' device")
        if self.host is not None:
            self.apply_now()
        self.host, self.host_blocks = host, host.num_slots // self.page
        self._launch = RecordMovesLaunch(self._slots, self._seq, self.rows, host, self.page)
        self._with.clear()

    def push(self, entries: array.array[int] | None) -> bool:
        """Queue ``entries`` (flat, :data:`ENTRY_WORDS` words each, already checked against the blocks of both sides)
        for the next step's work; False, nothing queued, for None, for more than the slot has room for, and while
        entries of an earlier step are still queued (none expected: each step's work takes its own).  The caller
        then mirrors the move at once, on the stream the step work runs on, after :meth:`apply_now`."""
        if entries is None:
            return False
        n = len(entries) // ENTRY_WORDS
        step = self._fence.next_step
        if (self.count and step != self._step) or self.count + n > CAPACITY:
            return False
        self._step = step
        words = self._slot_words[step % NUM_SLOTS]
        at = HEAD_WORDS + self.count * ENTRY_WORDS
        words[at : at + len(entries)] = memoryview(entries)
        self.count += n
        words[0] = self.count
        self.counts.queued_move_entries += n
        return True

    def prelude(self, prelude: Launches | None) -> Launches | None:
        """The step's prelude with the record moves added, in every step (the same object for the same ``prelude``, so
        a step's graph key is found again: a step with moves needs no graph of its own).  A step with nothing queued
        gets a slot that says so (its count word was an earlier step's); entries queued for a step that ran without
        them (not expected) are applied at once first."""
        step = self._fence.next_step
        if self.count and self._step != step:
            self.apply_now()
        if not self.count:
            self._slot_words[step % NUM_SLOTS][0] = 0
        kept = self._with.get(id(prelude))
        if kept is None or kept[0] is not prelude:
            if len(self._with) >= _MAX_PRELUDES:
                self._with.clear()
            launches = () if prelude is None else prelude.launches
            kept = self._with[id(prelude)] = (prelude, Launches((*launches, self._launch)))
        return kept[1]

    def taken(self) -> None:
        """The step's work (its prelude from :meth:`prelude`) was queued: its entries are the device's now."""
        if self.count:
            self.counts.steps_with_queued_moves += 1
            self.count = 0

    def apply_now(self) -> None:
        """Apply the queued entries at once (torch ops on the current stream: the caller's the step work's) and empty
        the queue."""
        if not self.count:
            return
        words = self._slot_words[self._step % NUM_SLOTS]
        apply_entries(words[HEAD_WORDS : HEAD_WORDS + self.count * ENTRY_WORDS], self.rows, self.host, self.page)
        self.counts.move_entries_applied_at_once += self.count
        self.count = 0
        words[0] = 0


class RecordMovesLaunch:
    """The record-move kernel bound to one queue's slots and records: a prelude launch (``key``: what it bakes in)."""

    __slots__ = ("args", "consts", "key")

    def __init__(
        self, slots: torch.Tensor, seq: torch.Tensor, rows: RecordRows, host: RecordRows | None, page: int
    ) -> None:
        side = rows if host is None else host  # no host rows yet: the device's stand in, with no block to address
        host_blocks = 0 if host is None else host.num_slots // page
        self.args = (
            slots, seq, int(slots.shape[1]), rows.pairs, rows.links, side.pairs, side.links,
            rows.pairs.stride(0), rows.links.stride(0), side.pairs.stride(0), side.links.stride(0),
            rows.num_slots // page, host_blocks,
        )  # fmt: skip
        groups = len(rows.links)
        block = max(16, 1 << (2 * groups * page - 1).bit_length())
        self.consts = {"GROUPS": groups, "PAGE": page, "BLOCK": block}
        self.key: tuple[object, ...] = (
            "record_moves",
            *(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in self.args),
            groups,
            page,
        )

    def run(self) -> None:
        from kvcanary.ops.kernels.record_moves import record_moves_kernel

        record_moves_kernel[(1,)](
            *self.args, HEAD_WORDS=HEAD_WORDS, NUM_SLOTS=NUM_SLOTS, CAPACITY=CAPACITY, num_warps=1, **self.consts
        )


def apply_entries(entries: Sequence[int], rows: RecordRows, host: RecordRows | None, page: int) -> None:
    """The record-move kernel's spec: ``entries`` (flat, :data:`ENTRY_WORDS` words each) applied in order to the
    device records ``rows`` and the host records ``host``; an entry whose blocks fall outside their side is skipped."""
    sides = (rows.blocks(page), None if host is None else host.blocks(page))
    limits = (rows.num_slots // page, 0 if host is None else host.num_slots // page)
    groups = len(rows.links)
    for i in range(0, len(entries) - ENTRY_WORDS + 1, ENTRY_WORDS):
        src, dst, flags = (int(w) for w in entries[i : i + ENTRY_WORDS])
        of, to = int(flags & FROM_HOST != 0), int(flags & TO_HOST != 0)
        if not (0 <= dst < limits[to] and src < limits[of]):
            continue
        source, dest = sides[of], sides[to]
        assert dest is not None and (src < 0 or source is not None)
        for g in range(groups):
            if flags >> (GROUP_SHIFT + g) & 1:
                for view, at in ((0, slice(2 * g, 2 * g + 2)), (1, slice(g, g + 1))):
                    dest[view][at, dst] = 0 if src < 0 else source[view][at, src]  # type: ignore[index]
