"""The vLLM fault library: each corrupts vLLM's own state the way a real bug did, never the canary's.

Worker side (model runner): a block-table row pointing into another request's block, a ``slot_mapping``
entry off by one, a wrong input token id, a preempted request resumed onto its stale blocks.  Engine-core
side (scheduler, block pool): a prefix-cache hash kept after its block was evicted and reused, and a
copy-on-write block copy that never happens (the relocation itself is vLLM's CoW path, :mod:`.cow`).
Byte faults (:mod:`.bytes`, seen only by the KV digest): a flipped bit, a stray write into a live slot, a
copy-on-write copy that lands damaged bytes.
"""

from __future__ import annotations

from typing import Any

from kvcanary.adapters.vllm.selftest.bytes import CowCopyCorruptsBytes, KVBitFlip, PaddingWriteLiveSlot
from kvcanary.adapters.vllm.selftest.context import RunnerFault, VllmInjector, decode_rows
from kvcanary.adapters.vllm.tiny import VOCAB
from kvcanary.selftest.protocol import Fault
from kvcanary.selftest.specs import load_specs

SPECS, _ = load_specs(__package__)  # faults.toml: each fault's spec, as data


class BlockTableCrossRequest(RunnerFault):
    spec = SPECS["block_table_cross_request"]
    method = "_update_states"
    after = True

    def _eligible(self, ctx: VllmInjector, so: Any) -> list[tuple[int, str]]:
        rows = decode_rows(ctx, so)
        return rows if len(rows) >= 2 else []

    def _corrupt(self, ctx: VllmInjector, so: Any, rows: list[tuple[int, str]]) -> None:
        (victim, vid), (donor, did) = ctx.rng.sample(rows, 2)
        table = ctx.runner.input_batch.block_table.block_tables[0].block_table.np
        state = ctx.runner.requests[vid]
        j = ctx.rng.randrange(state.num_computed_tokens // ctx.block_size)
        table[victim, j] = table[donor, 0]
        ctx.injected(f"row {victim} ({vid}) block {j} -> block {table[donor, 0]} of {did}", [vid, did])


class SlotMappingOffByOne(Fault[VllmInjector]):
    spec = SPECS["slot_mapping_off_by_one"]

    def install(self, ctx: VllmInjector) -> None:
        table = ctx.runner.input_batch.block_table.block_tables[0]

        def make(original: Any) -> Any:
            def compute_slot_mapping(num_reqs: int, query_start_loc: Any, positions: Any) -> Any:
                out = original(num_reqs, query_start_loc, positions)
                ctx.guard(self._corrupt)(ctx, table, num_reqs, int(positions.shape[0]))
                return out

            return compute_slot_mapping

        ctx.wrap(table, "compute_slot_mapping", make)

    def _corrupt(self, ctx: VllmInjector, table: Any, num_reqs: int, num_tokens: int) -> None:
        if num_tokens == 0 or not ctx.canary._in_step:
            return
        limit = ctx.canary.groups[0].canary.num_slots
        if not 0 <= int(table.slot_mapping.gpu[num_tokens - 1]) + 1 < limit or not ctx.take(self.name):
            return  # the engine's own KV write must stay inside its cache tensor
        rid = ctx.runner.input_batch.req_ids[num_reqs - 1]
        table.slot_mapping.gpu[num_tokens - 1] += 1
        ctx.injected(f"token {num_tokens - 1} of {rid} writes slot +1", [rid])


class WrongTokenId(RunnerFault):
    spec = SPECS["wrong_token_id"]
    method = "_prepare_inputs"

    def _eligible(self, ctx: VllmInjector, so: Any) -> list[tuple[int, str]]:
        return decode_rows(ctx, so)

    def _corrupt(self, ctx: VllmInjector, so: Any, rows: list[tuple[int, str]]) -> None:
        row, rid = ctx.rng.choice(rows)
        pos = ctx.runner.requests[rid].num_computed_tokens
        ids = ctx.runner.input_batch.token_ids_cpu
        ids[row, pos] = 3 + (int(ids[row, pos]) - 2) % (VOCAB - 3)
        ctx.injected(f"{rid} position {pos}: token id changed", [rid])


class ResumeOntoStaleBlocks(RunnerFault):
    spec = SPECS["resume_onto_stale_blocks"]
    method = "_update_states"

    def _eligible(self, ctx: VllmInjector, so: Any) -> list[str]:
        cached = so.scheduled_cached_reqs
        width = ctx.runner.input_batch.block_table.block_tables[0].max_num_blocks_per_req
        stale = []
        for rid, new in zip(cached.req_ids, cached.new_block_ids, strict=True):
            state = ctx.runner.requests.get(rid)
            old = state.block_ids[0] if state is not None else []
            # Eligible: a resumed request whose old and new blocks fit one block-table row together.
            if rid in cached.resumed_req_ids and old and new is not None and len(old) + len(new[0]) <= width:
                stale.append(rid)
        return stale

    def _corrupt(self, ctx: VllmInjector, so: Any, stale: list[str]) -> None:
        rid = ctx.rng.choice(stale)
        so.scheduled_cached_reqs.resumed_req_ids.discard(rid)
        ctx.injected(f"{rid} resumed onto its {len(ctx.runner.requests[rid].block_ids[0])} old blocks", [rid])


class StalePrefixHash(Fault[VllmInjector]):
    spec = SPECS["stale_prefix_hash"]

    def install(self, ctx: VllmInjector) -> None:
        pool = ctx.block_pool

        def make(original: Any) -> Any:
            def _remove_cached_block_hashes(block: Any) -> Any:
                removed = original(block)
                if removed:
                    ctx.guard(self._keep)(ctx, block, removed)
                return removed

            return _remove_cached_block_hashes

        ctx.wrap(pool, "_remove_cached_block_hashes", make)

    def _keep(self, ctx: VllmInjector, block: Any, removed: list[Any]) -> None:
        from vllm.v1.core.kv_cache_utils import get_block_hash

        # Eligible: a waiting request will look this hash up (otherwise nothing would ever read the stale entry).
        hashes = {get_block_hash(k) for k in removed}
        if not any(hashes.intersection(r.block_hashes) for r in ctx.scheduler.waiting) or not ctx.take(self.name):
            return
        for key in removed:
            ctx.block_pool.cached_block_hash_to_block.insert(key, block)
        ctx.injected(f"block {block.block_id} evicted, its hash kept", [])


class CowCopyDropped(Fault[VllmInjector]):
    spec = SPECS["cow_copy_dropped"]

    def install(self, ctx: VllmInjector) -> None:
        ctx.cow_filters.append(self._drop)

    def _drop(self, ctx: VllmInjector, rid: str, pair: tuple[int, int]) -> bool:
        """True keeps the copy; False drops it (once, at the target)."""
        if not ctx.take(self.name):
            return True
        ctx.injected(f"copy {pair[0]} -> {pair[1]} of {rid} dropped", [rid])
        return False


FAULTS: dict[str, type[Fault[Any]]] = {
    f.spec.name: f
    for f in (
        BlockTableCrossRequest, SlotMappingOffByOne, StalePrefixHash, CowCopyDropped, ResumeOntoStaleBlocks,
        WrongTokenId, KVBitFlip, PaddingWriteLiveSlot, CowCopyCorruptsBytes,
    )
}  # fmt: skip
