"""Faults in the block allocator's bookkeeping: a block freed while still referenced, a block freed twice.

transformers keeps free blocks per allocator in ``CachePool`` (``RegularTrees``: per sector, a list of
free block ids, handed out from the end of the first sector's list) and reference counts / hashes in a
``BlockLedger``.  Both faults put a live block back into the free list, the way a missing ownership check
does, and move it to the front so the next allocation -- not one in a hundred steps -- receives it; from
then on two owners write the same slots.
"""

from __future__ import annotations

from typing import Any

from kvcanary.adapters.transformers_cb.selftest.context import AllocatorFault, FaultContext
from kvcanary.adapters.transformers_cb.selftest.specs import SPECS


def free_list_contains(pool: Any, index: int, block: int) -> bool:
    """The block is free: in its allocator's free list, or its whole sector is back in the pool."""
    free = pool._free_blocks[index]
    if any(block in leaves for leaves in free.trees.values()):
        return True
    return block // free.elems_per_tree in pool.free_sectors


def release_once(alloc: Any, request_id: str, block: int) -> None:
    """Before ``request_id``'s blocks are freed: after the fault, ``block`` goes back to the free list only
    when its last owner frees it, once.  The fault is one bad free; without this every later owner would
    free it again and transformers' sector bookkeeping (which trusts the free list) would eventually hand
    out fewer blocks than it counts -- an engine crash, not the silent corruption being modelled."""
    table = alloc.block_table.get(request_id)
    if not table or block not in table:
        return
    others = any(block in t for rid, t in alloc.block_table.items() if rid != request_id)
    keep = [b for b in table if b != block]
    if not others and not free_list_contains(alloc.pool, alloc.index, block):
        keep.append(block)
    table[:] = keep


def hand_out_next(pool: Any, index: int, block: int) -> None:
    """Reorder the allocator's free list so that ``block`` (every copy of it) is handed out first."""
    free = pool._free_blocks[index]
    root = block // free.elems_per_tree
    leaves = free.trees[root]
    copies = leaves.count(block)
    rest = [b for b in leaves if b != block]
    free.trees = {root: rest + [block] * copies, **{r: v for r, v in free.trees.items() if r != root}}


def allocations_ahead(ctx: FaultContext) -> int:
    """Requests that will ask for fresh blocks soon: waiting to start, or with a prefill still split."""
    sched = ctx.scheduler
    return len(sched.waiting_requests) + sum(bool(s.remaining_prefill_tokens) for s in sched.active_requests.values())


class UseAfterFree(AllocatorFault):
    spec = SPECS["use-after-free"]

    def install_on(self, ctx: FaultContext, alloc: Any) -> None:
        def after_update() -> None:
            if not allocations_ahead(ctx):
                return
            options = []
            for rid, state in ctx.scheduler.active_requests.items():
                table = alloc.block_table.get(rid, [])
                full_pages = min(int(state.position_offset) // ctx.page_size, len(table))
                if ctx.remaining(rid) < 3 or state.is_cpu_offloaded:
                    continue
                for page in range(full_pages):
                    block = int(table[page])
                    owners = sum(t.count(block) for t in alloc.block_table.values())
                    if owners == 1 and block not in alloc.ledger.shared_ref_counts:
                        options.append((rid, page, block))
            if options and ctx.take(self.name):
                rid, page, block = ctx.rng.choice(options)
                alloc.pool.free_blocks(alloc.index, [block])
                hand_out_next(alloc.pool, alloc.index, block)
                freed.append(block)
                ctx.injected(f"block {block} (page {page} of {rid!r}) freed while still in its table", [rid])

        freed: list[int] = []

        def make(inner: Any) -> Any:
            def free_blocks(request_id: str, no_cache: bool = False) -> None:
                for block in freed:
                    release_once(alloc, request_id, block)
                inner(request_id, no_cache)

            return free_blocks

        ctx.after_update(after_update)
        ctx.wrap(alloc, "free_blocks", make)


class DoubleFree(AllocatorFault):
    spec = SPECS["double-free"]

    def install_on(self, ctx: FaultContext, alloc: Any) -> None:
        doubled: list[int] = []  # the block freed twice
        pending: list[int] = []  # its second copy, queued until the first one has been handed out
        handed: list[int] = []  # the first copy went out this step: the second joins the free list after it

        def make_free(inner: Any) -> Any:
            def free_blocks(request_id: str, no_cache: bool = False) -> None:
                for block in doubled:
                    release_once(alloc, request_id, block)
                before = list(alloc.block_table.get(request_id, []))
                inner(request_id, no_cache)
                if doubled:
                    return
                freed = [b for b in before if ctx.guard(free_list_contains)(alloc.pool, alloc.index, b)]
                if freed and allocations_ahead(ctx) >= 2 and ctx.take(self.name):  # one per copy
                    block = int(ctx.rng.choice(freed))
                    hand_out_next(alloc.pool, alloc.index, block)
                    doubled.append(block)
                    pending.append(block)
                    ctx.injected(f"block {block} of {request_id!r} freed twice")

            return free_blocks

        def make_get(inner: Any) -> Any:
            def get_free_blocks(index: int, num_blocks: int) -> list[int]:
                out: list[int] = inner(index, num_blocks)
                if index == alloc.index and pending and pending[0] in out:
                    handed.append(pending.pop())
                return out

            return get_free_blocks

        def after_update() -> None:
            # The second copy joins the free list once the step that handed out the first has run: two owners in
            # two different steps.  (Both copies taken in one scheduling pass -- by one request, or by two that
            # then write the block in the same forward -- is a case the canary cannot see: two writes to one slot
            # in one step leave either record.)  It is timed while the first owner still has tokens to generate:
            # a block overwritten during its owner's very last forward is read by nothing afterwards.
            for block in list(handed):
                owners = [rid for rid, t in alloc.block_table.items() if block in t]
                if not owners:
                    handed.remove(block)  # the first owner is gone: no second owner any more
                elif all(ctx.remaining(rid) >= 3 for rid in owners):
                    handed.remove(block)
                    alloc.pool.free_blocks(alloc.index, [block])
                    hand_out_next(alloc.pool, alloc.index, block)

        ctx.wrap(alloc, "free_blocks", make_free)
        ctx.wrap(alloc.pool, "get_free_blocks", make_get)
        ctx.after_update(after_update)
