"""A scripted paged-KV engine for pipeline tests: real bookkeeping, no model.

It keeps the state a serving engine keeps, in sglang's vocabulary: a pool of slots with a free list
and reference counts (slot 0 reserved), a request table ``req_to_token`` whose row 0 is the padding
row, prefix sharing (a new request's table entries point at an existing request's slots), chunked
prefill, decode, freeing a finished request's slots and handing them to new requests, and a
sliding-window group whose slots live in their own smaller pool, reached through an int64
full->window lookup table (like sglang's ``full_to_swa_index_mapping``) and recycled as windows
slide.  Each step it emits the canonical :class:`~kvcanary.StepBatch` of both groups and the
scheduler's ground truth (tokens per table row, with valid lengths); its pools, requests and step
are in :mod:`scripted_parts`.

Faults are injected through hooks that edit the engine's own state at a chosen step (its allocator,
its tables, its lookup table, the forward batch it hands out), the way a real bookkeeping bug does.
The engine keeps running on corrupted state (double frees are counted, not raised), so a test can
watch what the canary reports.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvcanary import CanaryGroup, GroupKind
from scripted_parts import (
    PADDING_ROW,
    RESERVED_SLOT,
    EngineStats,
    EngineStep,
    Owner,
    Request,
    RequestSpec,
    SlotPool,
    scripted_token,
)

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
