"""A stale prefix-cache entry: a block evicted for reuse while its hash still matches a prompt prefix.

transformers keeps complete, unreferenced blocks in ``BlockLedger.cached_blocks`` with their content hash
(a chain over every token from position 0); a new request whose prompt starts with the same tokens shares
them instead of recomputing.  Eviction (``evict_cached_blocks``) returns such blocks to the free list and
must forget their hashes.  The fault evicts one cached block but leaves its hash in the ledger, as in the
catalogue's most frequent bug class, just as the ledger serves it by hash (a new prompt's prefix match, or
the in-place de-duplication of a block a request just completed): the request takes the block as cached
while it is back in the free list, and the next allocation writes other tokens into it.
"""

from __future__ import annotations

from typing import Any

from kvcanary.adapters.transformers_cb.selftest.allocator import allocations_ahead, hand_out_next
from kvcanary.adapters.transformers_cb.selftest.context import FULL, FaultContext, TransformersFault
from kvcanary.adapters.transformers_cb.selftest.specs import SPECS


class StalePrefixHit(TransformersFault):
    spec = SPECS["stale-prefix-hit"]

    def install(self, ctx: FaultContext) -> None:
        alloc = ctx.allocator(FULL)
        if alloc is None or not ctx.cache.use_prefix_sharing:
            return
        ledger = alloc.ledger

        serving: list[str] = []  # the request a block is being served to by hash, while that happens

        def make_serve(inner: Any) -> Any:
            def serve(request_id: str, *args: Any) -> Any:
                serving.append(request_id)
                try:
                    return inner(request_id, *args)
                finally:
                    serving.pop()

            return serve

        def make_acquire(inner: Any) -> Any:
            def acquire(block_id: int) -> None:
                # A cached block served by hash is unreferenced; the fault needs its new holder to read on and
                # someone to allocate (and overwrite the block) soon.
                holder = serving[-1] if serving else None
                if (
                    holder is not None
                    and block_id in ledger.cached_blocks
                    and ctx.remaining(holder) >= 3
                    and allocations_ahead(ctx) >= 1
                    and ctx.take(self.name)
                ):
                    ledger.cached_blocks.pop(block_id)  # evicted ... while hash_to_block / block_to_hash keep it
                    alloc.pool.free_blocks(alloc.index, [block_id])
                    hand_out_next(alloc.pool, alloc.index, block_id)
                    ctx.injected(
                        f"cached block {block_id} evicted with its hash kept, then served to {holder!r}", [holder]
                    )
                inner(block_id)

            return acquire

        ctx.wrap(ledger, "acquire", make_acquire)
        ctx.wrap(alloc, "acquire_prefix_blocks", make_serve)  # a new prompt's prefix match
        ctx.wrap(alloc, "mark_complete_blocks", make_serve)  # in-place de-duplication of a completed block
