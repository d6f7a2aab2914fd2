"""A scripted paged-KV engine for pipeline tests: real bookkeeping, no model.

It keeps the state a serving engine keeps, in sglang's vocabulary: a pool of slots with a free list
and reference counts (slot 0 reserved), a request table ``req_to_token`` whose row 0 is the padding
row, prefix sharing (a new request's table entries point at an existing request's slots), chunked
prefill, decode, freeing a finished request's slots and handing them to new requests, and a
sliding-window group whose slots live in their own smaller pool, reached through an int64
full->window lookup table (like sglang's ``full_to_swa_index_mapping``) and recycled as windows
slide.  Each step it emits the canonical :class:`~kvcanary.StepBatch` of both groups and the
scheduler's ground truth (tokens per table row, with valid lengths).

Faults are injected through hooks that edit the engine's own state at a chosen step (its allocator,
its tables, its lookup table, the forward batch it hands out), the way a real bookkeeping bug does.
The engine keeps running on corrupted state (double frees are counted, not raised), so a test can
watch what the canary reports.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from kvcanary import CanaryGroup, GroupKind, StepBatch

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


BeforeAlloc = Callable[["ScriptedEngine"], None]
BeforeForward = Callable[["ScriptedEngine", EngineStep], None]


class ScriptedEngine:
    """Runs a list of :class:`RequestSpec` one step at a time: ``begin_step``, the forward (the
    canary, in tests), ``end_step``.  ``window`` is the sliding window of the window group; a
    request keeps window slots for its last ``window + 1`` positions (the window and the
    predecessor of its first entry, so every verified entry's chain link can be checked).
    """

    def __init__(
        self,
        specs: list[RequestSpec],
        *,
        full_slots: int = 64,
        window_slots: int = 24,
        window: int = 4,
        table_rows: int = 6,
        table_width: int = 24,
        pad_decode_to: int = 4,
    ) -> None:
        self.specs = sorted(specs, key=lambda s: (s.arrival, s.rid))
        self.window = window
        self.pad_decode_to = pad_decode_to
        self.req_to_token = torch.zeros(table_rows, table_width, dtype=torch.int32)
        self.truth = torch.zeros(table_rows, table_width, dtype=torch.int32)
        self.full_to_window = torch.zeros(full_slots, dtype=torch.int64)
        self.full_pool = SlotPool(full_slots, "full")
        self.window_pool = SlotPool(window_slots, "window")
        self.free_rows = list(range(table_rows - 1, PADDING_ROW, -1))
        self.running: list[Request] = []
        self.requests: dict[int, Request] = {}
        self.finished: list[int] = []
        self.stats = EngineStats()
        self.step_index = 0
        self._pending = list(self.specs)
        self._before_alloc: dict[int, list[BeforeAlloc]] = {}
        self._before_forward: dict[int, list[BeforeForward]] = {}
        self._current: EngineStep | None = None
        self._scheduled: list[tuple[Request, int]] = []

    # ------------------------------------------------------------------ groups and hooks

    def canary_groups(self) -> tuple[CanaryGroup, CanaryGroup]:
        full = CanaryGroup(num_slots=len(self.full_pool.refs), group_id=0, name="full")
        window = CanaryGroup(
            num_slots=len(self.window_pool.refs),
            group_id=1,
            name="window",
            kind=GroupKind.SLIDING_WINDOW,
            window=self.window,
            uses_lookup=True,
        )
        return full, window

    def before_alloc(self, step: int, hook: BeforeAlloc) -> None:
        """Run ``hook(engine)`` at ``step`` after admissions, before this step's slots are allocated."""
        self._before_alloc.setdefault(step, []).append(hook)

    def before_forward(self, step: int, hook: BeforeForward) -> None:
        """Run ``hook(engine, step)`` at ``step`` once the batch is built, before the canary sees it."""
        self._before_forward.setdefault(step, []).append(hook)

    # ------------------------------------------------------------------ queries

    @property
    def done(self) -> bool:
        return not self._pending and not self.running

    def request(self, rid: int) -> Request:
        return self.requests[rid]

    def slot_at(self, rid: int, pos: int) -> int:
        return int(self.req_to_token[self.requests[rid].row, pos])

    def window_slot_at(self, rid: int, pos: int) -> int:
        return int(self.full_to_window[self.slot_at(rid, pos)])

    def owner(self, rid: int, pos: int) -> Owner:
        return Owner(rid, pos, self.requests[rid].tokens[pos])

    # ------------------------------------------------------------------ the step

    def begin_step(self) -> EngineStep:
        if self._current is not None:
            raise RuntimeError("begin_step called twice without end_step")
        k = self.step_index
        while self._pending and self._pending[0].arrival <= k:
            self._admit(self._pending.pop(0))
        for hook in self._before_alloc.get(k, []):
            hook(self)
        step = self._schedule(k)
        for fwd in self._before_forward.get(k, []):
            fwd(self, step)
        self._current = step
        return step

    def end_step(self) -> None:
        if self._current is None:
            raise RuntimeError("end_step called without begin_step")
        for req, ext in self._scheduled:
            req.written += ext
            self._slide_window(req, req.written - self.window - 1)
        for req in [r for r, _ in self._scheduled if r.written >= r.total]:
            self._finish(req)
        self._scheduled = []
        self._current = None
        self.step_index += 1

    # ------------------------------------------------------------------ bookkeeping

    def _admit(self, spec: RequestSpec) -> None:
        if not self.free_rows:
            raise RuntimeError("no free table row (script needs more rows)")
        row = self.free_rows.pop()
        tokens = [scripted_token(spec.rid, p, spec.prompt_len) for p in range(spec.prompt_len + spec.decode_steps)]
        req = Request(spec, row, tokens)
        if spec.share_from is not None:
            src = self.requests[spec.share_from]
            n = spec.share_len
            keep_from = max(0, n - self.window - 1)
            if src.written < n or src.window_from > keep_from or n >= spec.prompt_len:
                raise ValueError(f"request {spec.rid} cannot share {n} tokens of request {src.rid} at this step")
            req.tokens[:n] = src.tokens[:n]
            for p in range(n):
                slot = int(self.req_to_token[src.row, p])
                self.req_to_token[row, p] = slot
                self.full_pool.share(slot)
                if p >= keep_from:
                    self.window_pool.share(int(self.full_to_window[slot]))
            req.written = n
            req.window_from = keep_from
            self.stats.shared_slots += n
        self.truth[row, : spec.prompt_len] = torch.tensor(req.tokens[: spec.prompt_len], dtype=torch.int32)
        self.requests[spec.rid] = req
        self.running.append(req)

    def _alloc_token(self, req: Request, pos: int) -> int:
        owner = self.owner(req.rid, pos)
        slot = self.full_pool.alloc(owner)
        self.full_to_window[slot] = self.window_pool.alloc(owner)
        self.req_to_token[req.row, pos] = slot
        return slot

    def _schedule(self, k: int) -> EngineStep:
        rids: list[int | None] = []
        rows, pre, ext, truth_lens = [], [], [], []
        ids: list[int] = []
        pos: list[int] = []
        loc: list[int] = []
        self._scheduled = []
        for req in self.running:
            n = req.next_extend()
            p0 = req.written
            prefill = p0 < req.spec.prompt_len
            if prefill and req.spec.chunk and p0 > 0:
                self.stats.chunk_continuations += 1
            if not prefill:
                self.stats.decode_rows += 1
                self.truth[req.row, p0] = req.tokens[p0]  # the token sampled last step is now known
            for p in range(p0, p0 + n):
                loc.append(self._alloc_token(req, p))
                ids.append(req.tokens[p])
                pos.append(p)
            rids.append(req.rid)
            rows.append(req.row)
            pre.append(p0)
            ext.append(n)
            truth_lens.append(max(req.spec.prompt_len, p0 + n))
            self._scheduled.append((req, n))
        all_decode = all(req.written >= req.spec.prompt_len for req, _ in self._scheduled)
        while all_decode and rows and len(rows) % self.pad_decode_to:
            # CUDA-graph padding: a row on the padding table row writing one token into slot 0.
            rids.append(None)
            rows.append(PADDING_ROW)
            pre.append(0)
            ext.append(1)
            truth_lens.append(0)
            ids.append(0)
            pos.append(0)
            loc.append(RESERVED_SLOT)
            self.stats.padding_rows += 1
        self._count_shared_reads(rows, pre)

        def i64(v: list[int]) -> torch.Tensor:
            return torch.tensor(v, dtype=torch.int64)

        return EngineStep(
            index=k,
            rids=rids,
            rows=i64(rows),
            prefix_lens=i64(pre),
            extend_lens=i64(ext),
            input_ids=torch.tensor(ids, dtype=torch.int32),
            positions=i64(pos),
            out_cache_loc=i64(loc),
            truth_lens=i64(truth_lens),
            table=self.req_to_token,
            truth=self.truth,
            lookup=self.full_to_window,
        )

    def _count_shared_reads(self, rows: list[int], pre: list[int]) -> None:
        readers: dict[int, int] = {}
        for row, n in zip(rows, pre, strict=True):
            if row != PADDING_ROW:
                for slot in set(self.req_to_token[row, :n].tolist()):
                    readers[slot] = readers.get(slot, 0) + 1
        self.stats.shared_reads += sum(1 for c in readers.values() if c > 1)

    def _slide_window(self, req: Request, upto: int) -> None:
        """Release the window slots of positions [window_from, upto): attention never reads them again."""
        for p in range(req.window_from, max(upto, req.window_from)):
            full = int(self.req_to_token[req.row, p])
            if self.window_pool.release(int(self.full_to_window[full])):
                self.full_to_window[full] = RESERVED_SLOT
                self.stats.window_released += 1
        req.window_from = max(upto, req.window_from)

    def _finish(self, req: Request) -> None:
        self._slide_window(req, req.written)
        for p in range(req.written):
            self.full_pool.release(int(self.req_to_token[req.row, p]))
        self.running.remove(req)
        self.free_rows.append(req.row)
        self.finished.append(req.rid)


def standard_workload() -> list[RequestSpec]:
    """Chunked prefill, decode, a prefix shared by two live requests, slots and a table row freed by
    finished requests and reused by new ones, and window slots recycled as windows slide.

    Step by step (window 4): request 1 prefills 10 tokens in two chunks (steps 0-1) and decodes at
    steps 2-9; request 2 prefills 6 at step 0 and decodes at steps 1-10; request 3 arrives at step 1
    on request 1's first 5 slots and decodes at steps 2-7; request 4 arrives at step 8 on request 3's
    table row and freed slots and prefills 7 tokens in chunks of 3 (steps 8-10), decoding at 11-14;
    request 5 arrives at step 11 on slots request 1 freed and decodes at steps 12-14.
    """
    return [
        RequestSpec(rid=1, arrival=0, prompt_len=10, decode_steps=8, chunk=5),
        RequestSpec(rid=2, arrival=0, prompt_len=6, decode_steps=10),
        RequestSpec(rid=3, arrival=1, prompt_len=8, decode_steps=6, share_from=1, share_len=5),
        RequestSpec(rid=4, arrival=8, prompt_len=7, decode_steps=4, chunk=3),
        RequestSpec(rid=5, arrival=11, prompt_len=4, decode_steps=3),
    ]
