"""Copy-on-write relocations on the real engine (the vLLM CPU path never needs one with a plain model).

vLLM 0.32 relocates a partially hit prefix block to a private copy (``SingleTypeKVCacheManager._apply_cow``)
and ships the (src, dst) pair in ``SchedulerOutput.kv_cache_block_copies``; the worker copies the bytes
(``copy_kv_cache_blocks_inplace``) before the forward.  Only hybrid block sizes produce partial hits, so the
self-test's workload makes the same redirection itself for requests admitted with prefix hits: in the step's
scheduler output, the request's last hit block is replaced by a fresh block from the pool (the scheduler's
own block list updated to match, its reference on the source dropped) and the pair is queued as a block
copy.  vLLM then copies the bytes and the canary its records; a clean run stays silent.  Faults may veto a
copy (:class:`~.faults.CowCopyDropped`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvcanary.adapters.vllm.selftest.context import VllmInjector

MIN_FREE_BLOCKS = 4  # leave the scheduler room: a relocation takes one block from the free pool

CopyFilter = Callable[[VllmInjector, str, tuple[int, int]], bool]


def install_relocations(ctx: VllmInjector) -> None:
    def make(original: Any) -> Any:
        def _update_states(so: Any, *a: Any, **k: Any) -> Any:
            ctx.guard(relocate)(ctx, so)
            return original(so, *a, **k)

        return _update_states

    ctx.wrap(ctx.runner, "_update_states", make)


def written_blocks(ctx: VllmInjector, so: Any) -> set[int]:
    """Blocks some token of this step writes (a copy taken before the forward would miss those bytes)."""
    starts = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
    cached = so.scheduled_cached_reqs
    starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
    out: set[int] = set()
    for rid, n in so.num_scheduled_tokens.items():
        blocks = ctx.request_blocks(rid)
        first, last = starts.get(rid, 0) // ctx.block_size, (starts.get(rid, 0) + n - 1) // ctx.block_size
        out.update(b.block_id for b in blocks[first : last + 1])
    return out


def relocate(ctx: VllmInjector, so: Any) -> None:
    pool = ctx.block_pool
    copies = list(so.kv_cache_block_copies or [])
    busy: set[int] | None = None
    for req in so.scheduled_new_reqs:
        hits = req.num_computed_tokens // ctx.block_size
        if hits == 0 or pool.get_num_free_blocks() < MIN_FREE_BLOCKS:
            continue
        j = hits - 1
        blocks = ctx.request_blocks(req.req_id)
        source = blocks[j]
        busy = written_blocks(ctx, so) if busy is None else busy
        if source.block_id in busy:
            continue  # written in this very step: vLLM never copies a block before its bytes land
        dest = pool.get_new_blocks(1)[0]
        blocks[j] = dest
        pool.free_blocks([source])
        req.block_ids[0][j] = dest.block_id
        pair = (source.block_id, dest.block_id)
        if all(keep(ctx, req.req_id, pair) for keep in ctx.cow_filters):
            copies.append(pair)
        ctx.relocations += 1
    so.kv_cache_block_copies = copies or None
