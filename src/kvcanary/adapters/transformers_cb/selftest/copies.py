"""Faults in the engine's bulk KV moves: fork block copies and CPU offload/restore.

The adapter moves the records where the engine's copies actually write in the cache (it watches the
block writes of ``CacheAllocator.copy_blocks`` and ``OffloadingManager.restore_scheduled_requests``), not
where its bookkeeping says the bytes should go.  So both kinds of bug are seen:

* the move is missing from the bookkeeping (a copy never requested, a restore never run while the request
  resumes at its old length): nothing is written, the request reads slots whose records belong to someone
  else or to nobody;
* the bookkeeping is right but the bytes go astray (a copy that lands in a buffer attention never reads, a
  restore that writes the right pages into the wrong blocks): the records follow the bytes, so the blocks
  the request reads hold records of other positions, or none.

The faults corrupt below the observation point: the engine's real ``index_copy_`` writes elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvcanary.adapters.transformers_cb.selftest.context import (
    FULL,
    CopyBlocks,
    FaultContext,
    TransformersFault,
    wrap_copy_blocks,
    wrap_restore,
)
from kvcanary.adapters.transformers_cb.selftest.specs import SPECS


class ForkSkipCopy(TransformersFault):
    spec = SPECS["fork-skip-copy"]

    def install(self, ctx: FaultContext) -> None:
        def make(inner: Any) -> Any:
            def prepare_fork_request(src_state: Any, dst_req_ids: list[str], copies: dict[str, Any]) -> list[str]:
                n0 = len(copies[FULL][0])
                forked: list[str] = inner(src_state, dst_req_ids, copies)
                src, dst = copies[FULL]
                if len(src) > n0 and forked and ctx.take(self.name):
                    s, d = src.pop(), dst.pop()
                    ctx.injected(f"fork of {src_state.request_id!r}: copy of block {s} -> {d} dropped", [forked[-1]])
                return forked

            return prepare_fork_request

        ctx.wrap(ctx.cache, "prepare_fork_request", make)


class ForkCopyLost(TransformersFault):
    spec = SPECS["fork-copy-lost"]

    def install(self, ctx: FaultContext) -> None:
        def copy(alloc: Any, inner: CopyBlocks, source_block_ids: list[int], dest_block_ids: list[int]) -> None:
            if not (source_block_ids and ctx.take(self.name)):
                inner(source_block_ids, dest_block_ids)
                return
            real = alloc._copy_view
            alloc._copy_view = real.clone()  # the copy lands here and is dropped
            try:
                inner(source_block_ids, dest_block_ids)  # the adapter sees the write miss the cache
            finally:
                alloc._copy_view = real
            dst = set(dest_block_ids)
            children = [rid for rid, table in alloc.block_table.items() if dst.intersection(table)]
            ctx.injected(f"copy of blocks {source_block_ids} -> {dest_block_ids} lost", children)

        wrap_copy_blocks(ctx, copy)


class OffloadRestoreLost(TransformersFault):
    spec = SPECS["offload-restore-lost"]

    def install(self, ctx: FaultContext) -> None:
        def make(inner: Any) -> Any:
            def restore_scheduled_requests(requests_in_batch: list[Any]) -> Any:
                offloaded = [fs.state for fs in requests_in_batch if fs.state.is_cpu_offloaded]
                if offloaded and ctx.take(self.name):
                    state = ctx.rng.choice(offloaded)
                    state.is_cpu_offloaded = False
                    ctx.injected(
                        f"restore of {state.request_id!r} ({state.position_offset} tokens) skipped", [state.request_id]
                    )
                return inner(requests_in_batch)

            return restore_scheduled_requests

        ctx.wrap(ctx.offloading, "restore_scheduled_requests", make)


class _MisdirectedView:
    """Stands in for an allocator's ``_copy_view`` during one restore: ``index_copy_`` sends blocks of
    ``remap`` to other blocks; everything else is the real view's.  The real ``index_copy_`` runs with the
    wrong ids, so what the adapter's write observer sees is the misdirected write itself."""

    def __init__(self, real: torch.Tensor, remap: dict[int, int]) -> None:
        self._real = real
        self._remap = remap

    def index_copy_(self, dim: int, index: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        moved = torch.tensor([self._remap.get(int(i), int(i)) for i in index.tolist()], dtype=index.dtype)
        return self._real.index_copy_(dim, moved.to(index.device), source)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _restorable(om: Any, alloc: Any, requests_in_batch: list[Any]) -> list[tuple[str, list[Any], list[Any], int]]:
    """The batch's CPU-offloaded requests with at least two pages to restore: (id, its host blocks (the
    engine's own list), its device table, pages restored)."""
    found = []
    for fs in requests_in_batch:
        rid = fs.state.request_id
        cpu = om._request_id_to_cpu_blocks.get(rid, {}).get(FULL, []) if fs.state.is_cpu_offloaded else []
        table = alloc.block_table.get(rid, [])
        n = min(len(cpu), len(table))
        if n >= 2:
            found.append((rid, cpu, table, n))
    return found


class OffloadRestoreWrongBlock(TransformersFault):
    spec = SPECS["offload-restore-wrong-block"]

    def install(self, ctx: FaultContext) -> None:
        def restore(alloc: Any, om: Any, inner: Callable[[list[Any]], Any], requests_in_batch: list[Any]) -> Any:
            options = [
                (rid, [int(b) for b in table[:n]]) for rid, _, table, n in _restorable(om, alloc, requests_in_batch)
            ]
            if not (options and ctx.take(self.name)):
                return inner(requests_in_batch)
            rid, blocks = ctx.rng.choice(options)
            remap = {b: blocks[(k + 1) % len(blocks)] for k, b in enumerate(blocks)}
            real = alloc._copy_view
            alloc._copy_view = _MisdirectedView(real, remap)
            try:
                out = inner(requests_in_batch)
            finally:
                alloc._copy_view = real
            ctx.injected(f"restore of {rid!r}: pages written to blocks {[remap[b] for b in blocks]}", [rid])
            return out

        wrap_restore(ctx, restore)


class OffloadRestoreWrongHostBlock(TransformersFault):
    spec = SPECS["offload-restore-wrong-host-block"]

    def install(self, ctx: FaultContext) -> None:
        def restore(alloc: Any, om: Any, inner: Callable[[list[Any]], Any], requests_in_batch: list[Any]) -> Any:
            options = _restorable(om, alloc, requests_in_batch)
            if options and ctx.take(self.name):
                rid, cpu, _, n = ctx.rng.choice(options)
                before = list(cpu[:n])
                cpu[:n] = before[1:] + before[:1]  # the bookkeeping the copy reads, not the adapter
                ctx.injected(f"restore of {rid!r}: host blocks {before} read as {cpu[:n]}", [rid])
            return inner(requests_in_batch)

        wrap_restore(ctx, restore)
