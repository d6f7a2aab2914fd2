"""Faults in the KV bytes themselves, which the token/position/link records do not describe.

The records say *which* token, position and prefix a slot holds; these faults change the bytes under a
correct record.  The KV digest (``docs/design.md`` §12; the self-test runs it at budget 1.0) sees them: a
slot's bytes no longer match the digest stamped when they were written, or that moved in with its record.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvcanary.adapters.transformers_cb.host_batch import HostBatch
from kvcanary.adapters.transformers_cb.selftest.context import (
    FULL,
    AllocatorFault,
    CopyBlocks,
    FaultContext,
    TransformersFault,
    batch_rows,
    read_segment_starts,
    wrap_copy_blocks,
    wrap_restore,
)
from kvcanary.adapters.transformers_cb.selftest.specs import SPECS


def flip_top_bit(block_bytes: torch.Tensor, element_size: int) -> None:
    """Flip the most significant bit of the block's first element: layer 0's K of its first token."""
    block_bytes[element_size - 1] ^= 0x80


class KVBitFlip(AllocatorFault):
    spec = SPECS["kv-bit-flip"]

    def install_on(self, ctx: FaultContext, alloc: Any) -> None:
        g = ctx.group_index(FULL)

        def before_forward(kwargs: dict[str, Any], host: HostBatch) -> None:
            rows = batch_rows(host)
            starts = read_segment_starts(rows, 0)
            readers = [(r, s) for r, s in zip(rows, starts, strict=True) if r.past > 0]
            read = kwargs["read_index"][g]
            if readers and read.numel() and ctx.take(self.name):
                r, s = ctx.rng.choice(readers)
                pos = ctx.rng.randrange(r.past)
                index = int(read[s + pos])
                layer = ctx.rng.choice(list(alloc.layer_indices))
                keys = alloc._kv_token_views[layer][0][index]
                flat = keys.view(-1)
                i = int(flat.abs().argmax())
                bits = flat.view(torch.int32)
                bits[i] ^= -(2**31)  # the float32 sign bit
                ctx.injected(f"sign bit of K[{i}] of {r.request_id!r} position {pos}, layer {layer}", [r.request_id])

        ctx.on_forward(before_forward)


class PaddingWriteLiveSlot(AllocatorFault):
    spec = SPECS["padding-write-live-slot"]

    def install_on(self, ctx: FaultContext, alloc: Any) -> None:
        victim: dict[int, int] = {}  # step -> physical index the padding entry points at

        def pick(read_index: torch.Tensor) -> int | None:
            host = ctx.host
            if host is None or not read_index.numel():
                return None
            rows = batch_rows(host)
            starts = read_segment_starts(rows, 0)
            live = [(r, s) for r, s in zip(rows, starts, strict=True) if r.past > 0]
            if len(rows) < 2 or not live or not ctx.take(self.name):
                return None
            r, s = ctx.rng.choice(live)
            pos = ctx.rng.randrange(r.past)
            ctx.injected(f"padding write into the slot of {r.request_id!r} position {pos}", [r.request_id])
            return int(read_index[s + pos])

        def make(inner: Any) -> Any:
            def update(key_states: Any, value_states: Any, layer_idx: int, read_index: Any, write_index: Any) -> Any:
                step = ctx.step
                if step not in victim:
                    chosen = ctx.guard(pick)(read_index)
                    if chosen is None:
                        return inner(key_states, value_states, layer_idx, read_index, write_index)
                    victim[step] = chosen
                extra = torch.tensor([victim[step]], dtype=write_index.dtype, device=write_index.device)
                return inner(
                    torch.cat([key_states, key_states[-1:]]),
                    torch.cat([value_states, value_states[-1:]]),
                    layer_idx,
                    read_index,
                    torch.cat([write_index, extra]),
                )

            return update

        ctx.wrap(alloc, "update", make)


class ForkCopyCorruptsBytes(TransformersFault):
    spec = SPECS["fork-copy-corrupts-bytes"]

    def install(self, ctx: FaultContext) -> None:
        def copy(alloc: Any, inner: CopyBlocks, source_block_ids: list[int], dest_block_ids: list[int]) -> None:
            inner(source_block_ids, dest_block_ids)
            if not (dest_block_ids and ctx.take(self.name)):
                return
            dst = int(dest_block_ids[0])
            what = self.damage(alloc, dst, int(source_block_ids[0]))
            children = [rid for rid, table in alloc.block_table.items() if dst in table]
            ctx.injected(f"copied block {dst}: {what} damaged after the copy", children)

        wrap_copy_blocks(ctx, copy)

    def damage(self, alloc: Any, dst: int, src: int) -> str:
        """Damage block ``dst``, just copied from ``src``; returns what was damaged (for the injection note)."""
        layer = alloc.layer_indices[0]
        flip_top_bit(alloc._copy_view[dst], alloc._kv_token_views[layer][0].element_size())
        return "first K element"


class OffloadRestoreStaleBytes(TransformersFault):
    spec = SPECS["offload-restore-stale-bytes"]

    def install(self, ctx: FaultContext) -> None:
        def restore(alloc: Any, om: Any, inner: Callable[[list[Any]], Any], requests_in_batch: list[Any]) -> Any:
            held = om._request_id_to_cpu_blocks
            options = [
                (fs.state.request_id, held[fs.state.request_id][FULL][0])
                for fs in requests_in_batch
                if fs.state.is_cpu_offloaded and held.get(fs.state.request_id, {}).get(FULL)
            ]
            if options and ctx.take(self.name):
                rid, host_block = ctx.rng.choice(options)
                layer = alloc.layer_indices[0]
                flip_top_bit(om._cpu_views[FULL][int(host_block)], alloc._kv_token_views[layer][0].element_size())
                ctx.injected(f"host block {int(host_block)} of {rid!r} damaged before its restore", [rid])
            return inner(requests_in_batch)

        wrap_restore(ctx, restore)
