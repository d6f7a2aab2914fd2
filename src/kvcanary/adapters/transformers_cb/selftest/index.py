"""Faults in the index tensors the engine builds for a step: which slots attention reads and writes,
the positions and the token ids it feeds the model.

transformers builds these on the host (``get_read_indices``/``get_write_indices`` per allocator, then
``prepare_batch_tensors`` copies them into static buffers); the faults corrupt either the allocator's
index construction or the static buffers the forward receives, as a bug in that code would.
"""

from __future__ import annotations

from typing import Any

from kvcanary.adapters.transformers_cb.host_batch import HostBatch
from kvcanary.adapters.transformers_cb.selftest.context import (
    FULL,
    SLIDING,
    AllocatorFault,
    FaultContext,
    ForwardFault,
    Row,
    batch_rows,
)
from kvcanary.adapters.transformers_cb.selftest.specs import SPECS


def _row_map(ctx: FaultContext) -> dict[str, Row]:
    host = ctx.host
    return {} if host is None else {r.request_id: r for r in batch_rows(host)}


class SlotMappingForeign(AllocatorFault):
    spec = SPECS["slot-mapping-foreign"]

    def install_on(self, ctx: FaultContext, alloc: Any) -> None:
        def make(inner: Any) -> Any:
            def get_read_indices(request_id: str, past_length: int, query_length: int) -> list[int]:
                out: list[int] = inner(request_id, past_length, query_length)
                plan = ctx.guard(self._find)(ctx, alloc, request_id, past_length)
                if plan is not None and ctx.take(self.name):
                    page, donor, block = plan
                    p, stride = ctx.page_size, alloc.block_physical_stride
                    out[page * p : (page + 1) * p] = range(block * stride, block * stride + p)
                    ctx.injected(
                        f"read indices of {request_id!r} page {page} -> block {block} of {donor!r}", [request_id]
                    )
                return out

            return get_read_indices

        ctx.wrap(alloc, "get_read_indices", make)

    def _find(self, ctx: FaultContext, alloc: Any, request_id: str, past: int) -> tuple[int, str, int] | None:
        rows = _row_map(ctx)
        me = rows.get(request_id)
        if me is None:
            return None
        p = ctx.page_size
        mine = alloc.block_table.get(request_id, [])
        options = []
        for page in range(min(past // p, len(mine))):
            end = (page + 1) * p
            for other in rows.values():
                theirs = alloc.block_table.get(other.request_id, [])
                if (
                    other.request_id != request_id
                    and other.past >= end
                    and len(theirs) > page
                    and theirs[page] != mine[page]
                    and list(other.history[:end]) != list(me.history[:end])  # really different content
                ):
                    options.append((page, other.request_id, int(theirs[page])))
        return ctx.rng.choice(options) if options else None


class ChunkBoundaryPosition(ForwardFault):
    spec = SPECS["chunk-boundary-position"]

    def before_forward(self, ctx: FaultContext, kwargs: dict[str, Any], host: HostBatch) -> None:
        chunks = [r for r in batch_rows(host) if r.past > 0 and r.query > 1]
        if chunks and ctx.take(self.name):
            r = ctx.rng.choice(chunks)
            kwargs["position_ids"].view(-1)[r.token_start : r.token_start + r.query] += 1
            ctx.injected(f"chunk of {r.request_id!r} at {r.past}..{r.past + r.query - 1} shifted by +1", [r.request_id])


class DroppedWrite(ForwardFault):
    spec = SPECS["dropped-write"]

    def before_forward(self, ctx: FaultContext, kwargs: dict[str, Any], host: HostBatch) -> None:
        alloc = ctx.allocator(FULL)
        decodes = [r for r in batch_rows(host) if r.query == 1 and r.past > 0]
        if alloc is not None and decodes and ctx.take(self.name):
            r = ctx.rng.choice(decodes)
            write = kwargs["write_index"][ctx.group_index(FULL)]
            old = int(write[r.token_start])
            write[r.token_start] = alloc.write_trash_index
            ctx.injected(f"write of {r.request_id!r} position {r.past} sent from {old} to the trash", [r.request_id])


class WriteIntoLiveSlot(ForwardFault):
    spec = SPECS["write-into-live-slot"]

    def before_forward(self, ctx: FaultContext, kwargs: dict[str, Any], host: HostBatch) -> None:
        alloc = ctx.allocator(FULL)
        if alloc is None:
            return
        pairs = [
            (r, o)
            for r in batch_rows(host)
            for o in batch_rows(host)
            if r.query == 1 and r.past > 0 and o.request_id != r.request_id and o.past > 0
        ]
        if pairs and ctx.take(self.name):
            r, victim = ctx.rng.choice(pairs)
            pos = ctx.rng.randrange(victim.past)
            p = ctx.page_size
            block = alloc.block_table[victim.request_id][pos // p]
            write = kwargs["write_index"][ctx.group_index(FULL)]
            write[r.token_start] = block * alloc.block_physical_stride + pos % p
            ctx.injected(
                f"write of {r.request_id!r} position {r.past} sent onto position {pos} of "
                f"{victim.request_id!r}, read in the same step",
                [r.request_id, victim.request_id],
            )


class WrongTokenId(ForwardFault):
    spec = SPECS["wrong-token-id"]

    def before_forward(self, ctx: FaultContext, kwargs: dict[str, Any], host: HostBatch) -> None:
        decodes = [r for r in batch_rows(host) if r.query == 1]
        if decodes and ctx.take(self.name):
            r = ctx.rng.choice(decodes)
            ids = kwargs["input_ids"].view(-1)
            old = int(ids[r.token_start])
            others = [int(ids[o.token_start]) for o in decodes if int(ids[o.token_start]) != old]
            new = ctx.rng.choice(others) if others else (old + 1) % 1000
            ids[r.token_start] = new
            ctx.injected(f"input id of {r.request_id!r} at position {r.past}: {old} -> {new}", [r.request_id])


class WindowRingOffByOne(AllocatorFault):
    spec = SPECS["window-ring-off-by-one"]
    group = SLIDING

    def install_on(self, ctx: FaultContext, alloc: Any) -> None:
        window = int(alloc.sliding_window)

        def make(inner: Any) -> Any:
            def get_read_indices(request_id: str, past_length: int, query_length: int) -> list[int]:
                if past_length >= window and ctx.take(self.name):
                    out: list[int] = alloc._token_indices_to_physical_indices(
                        request_id, past_length % window, window - 1
                    )
                    ctx.injected(
                        f"ring read of {request_id!r} at past {past_length} starts one slot early", [request_id]
                    )
                    return out + [alloc.sentinel_index] * query_length
                result: list[int] = inner(request_id, past_length, query_length)
                return result

            return get_read_indices

        ctx.wrap(alloc, "get_read_indices", make)
