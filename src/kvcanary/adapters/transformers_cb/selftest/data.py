"""Faults in the KV bytes themselves, which the token/position/link records do not describe.

Both are expected misses: the canary verifies *which* token, position and prefix a slot was stamped with,
and neither fault touches those records -- the bytes under a correct record change.  They stay in the
matrix so the miss is measured (the oracle shows attention really read the damaged bytes) and so the KV
digest, when it lands, turns them into detections.
"""

from __future__ import annotations

from typing import Any

import torch

from kvcanary.adapters.transformers_cb.host_batch import HostBatch
from kvcanary.adapters.transformers_cb.selftest.context import (
    FULL,
    FaultContext,
    TransformersFault,
    batch_rows,
    read_segment_starts,
)
from kvcanary.adapters.transformers_cb.selftest.specs import SPECS


class KVBitFlip(TransformersFault):
    spec = SPECS["kv-bit-flip"]

    def install(self, ctx: FaultContext) -> None:
        alloc = ctx.allocator(FULL)
        if alloc is None:
            return
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


class PaddingWriteLiveSlot(TransformersFault):
    spec = SPECS["padding-write-live-slot"]

    def install(self, ctx: FaultContext) -> None:
        alloc = ctx.allocator(FULL)
        if alloc is None:
            return
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
