"""The scripted engine's parts: its slot pools, requests and the step it hands out (:mod:`scripted_engine`).

A pool of slots with a free list and reference counts, the requests a workload admits (with their
scripted tokens), and one step's forward batch with its ground truth, as the canonical
:class:`~kvcanary.StepBatch` of each group.
"""

from __future__ import annotations

import dataclasses

import torch

from kvcanary import StepBatch

RESERVED_SLOT = 0
PADDING_ROW = 0


@dataclasses.dataclass(frozen=True)
class Owner:
    """Who a slot was handed to: the request, the position and the token it was meant to hold."""

    rid: int
    pos: int
    token: int


class SlotPool:
    """Slots [0, num_slots) with reference counts and a LIFO free list (freed slots are reused first).

    The reserved slot is never handed out.  ``force_next`` is the fault hook: the next allocation
    returns that slot whatever its reference count, as a buggy allocator would.
    """

    def __init__(self, num_slots: int, name: str) -> None:
        self.name = name
        self.refs = [0] * num_slots
        # A stack popped from the end: fresh slots come out in ascending order.
        self.free = list(range(num_slots - 1, RESERVED_SLOT, -1))
        self.history: list[list[Owner]] = [[] for _ in range(num_slots)]
        self.forced: list[int] = []
        self.reused = 0  # allocations of a slot that had been handed out before
        self.double_frees = 0

    def alloc(self, owner: Owner) -> int:
        if self.forced:
            slot = self.forced.pop(0)
        elif self.free:
            slot = self.free.pop()
        else:
            raise RuntimeError(f"{self.name} pool exhausted (script needs a bigger pool)")
        if self.history[slot]:
            self.reused += 1
        self.history[slot].append(owner)
        self.refs[slot] = 1
        return slot

    def share(self, slot: int) -> None:
        self.refs[slot] += 1

    def release(self, slot: int) -> bool:
        """Drop one reference; True when the slot went back to the free list."""
        if slot == RESERVED_SLOT or self.refs[slot] <= 0:
            self.double_frees += 1  # only reachable on corrupted state
            return False
        self.refs[slot] -= 1
        if self.refs[slot]:
            return False
        self.free.append(slot)
        return True

    def force_next(self, slot: int) -> None:
        self.forced.append(slot)

    def previous_owner(self, slot: int) -> Owner | None:
        """The owner before the latest allocation of ``slot`` (None when it was fresh)."""
        h = self.history[slot]
        return h[-2] if len(h) >= 2 else None


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """One scripted request: arrives at step ``arrival``, prefills ``prompt_len`` tokens (in chunks of
    ``chunk`` when non-zero), then writes ``decode_steps`` tokens one per step.  With ``share_from``
    its first ``share_len`` prompt tokens are that request's and reuse its slots (a prefix-cache hit).
    """

    rid: int
    arrival: int
    prompt_len: int
    decode_steps: int
    chunk: int = 0
    share_from: int | None = None
    share_len: int = 0


def scripted_token(rid: int, pos: int, prompt_len: int) -> int:
    """Distinct per request and position, so a record from the wrong slot shows a wrong token."""
    return 1000 * rid + pos + (1 if pos < prompt_len else 501)


@dataclasses.dataclass
class Request:
    spec: RequestSpec
    row: int
    tokens: list[int]
    written: int = 0  # positions [0, written) are in the cache: the next step's prefix_len
    window_from: int = 0  # positions [window_from, written) hold a window-slot reference

    @property
    def rid(self) -> int:
        return self.spec.rid

    @property
    def total(self) -> int:
        return self.spec.prompt_len + self.spec.decode_steps

    def next_extend(self) -> int:
        left = self.spec.prompt_len - self.written
        if left <= 0:
            return 1
        return min(left, self.spec.chunk) if self.spec.chunk else left


@dataclasses.dataclass
class EngineStats:
    shared_slots: int = 0  # table entries mapped onto another request's slots at admission
    shared_reads: int = 0  # (step, slot) pairs in the prefix of two or more batch rows
    chunk_continuations: int = 0  # prefill chunks that extend a non-empty prefix of a chunked prompt
    decode_rows: int = 0
    padding_rows: int = 0
    window_released: int = 0  # window slots freed by sliding or finishing


@dataclasses.dataclass
class EngineStep:
    """One forward step: the per-row and per-token tensors the engine hands its model, plus views.

    ``table``, ``truth`` and ``lookup`` are the engine's live tensors (not copies), so a fault in
    the engine's state shows in every batch built from them.  Hooks may edit the per-token tensors
    in place before the canary sees them; the batches are built on demand from these fields.
    """

    index: int
    rids: list[int | None]  # per batch row; None for padding
    rows: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    truth_lens: torch.Tensor
    table: torch.Tensor
    truth: torch.Tensor
    lookup: torch.Tensor
    dropped: list[int] = dataclasses.field(default_factory=list)

    def batch_row(self, rid: int) -> int:
        return self.rids.index(rid)

    def token_index(self, rid: int, i: int = 0) -> int:
        """Flat index (into input_ids / positions / out_cache_loc) of request ``rid``'s i-th token."""
        r = self.batch_row(rid)
        if not 0 <= i < int(self.extend_lens[r]):
            raise IndexError(f"request {rid} writes {int(self.extend_lens[r])} tokens this step, not {i + 1}")
        return int(self.extend_lens[:r].sum()) + i

    def drop_token(self, t: int) -> None:
        """Remove token ``t`` from the canary's view: its stamp never happens (the write is lost)."""
        r = int(torch.searchsorted(torch.cumsum(self.extend_lens, 0), t, right=True))
        keep = torch.ones(self.input_ids.shape[0], dtype=torch.bool)
        keep[t] = False
        self.extend_lens = self.extend_lens.clone()
        self.extend_lens[r] -= 1
        self.input_ids = self.input_ids[keep].contiguous()
        self.positions = self.positions[keep].contiguous()
        self.out_cache_loc = self.out_cache_loc[keep].contiguous()
        self.dropped.append(t)

    def _batch(self, with_truth: bool, lookup: torch.Tensor | None) -> StepBatch:
        return StepBatch(
            rows=self.rows,
            prefix_lens=self.prefix_lens,
            extend_lens=self.extend_lens,
            table=self.table,
            input_ids=self.input_ids,
            positions=self.positions,
            out_cache_loc=self.out_cache_loc,
            truth=self.truth if with_truth else None,
            truth_lens=self.truth_lens if with_truth else None,
            lookup=lookup,
        )

    def full(self, with_truth: bool) -> StepBatch:
        return self._batch(with_truth, None)

    def window(self, with_truth: bool) -> StepBatch:
        """The window group's batch: the same table and out_cache_loc in full-slot space, plus the lookup."""
        return self._batch(with_truth, self.lookup)
