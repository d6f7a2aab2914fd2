"""Faults in the KV bytes themselves, which the token/position/link records do not describe.

Both are expected misses: the canary verifies *which* token, position and prefix a slot was stamped with,
and neither fault touches those records -- the bytes under a correct record change.  They stay in the
matrix so the miss is measured (the oracle shows attention really read the damaged bytes) and so the KV
digest, when it lands, turns them into detections.
"""

from __future__ import annotations

from typing import Any

import torch

from kvcanary.adapters.transformers_cb.selftest.context import (
    FULL,
    FaultContext,
    TransformersFault,
    batch_rows,
    read_segment_starts,
)
from kvcanary.selftest.protocol import Expect, FaultSpec


class KVBitFlip(TransformersFault):
    spec = FaultSpec(
        name="kv-bit-flip",
        bug_class="flipped bits in stored K/V",
        catalogue="B.15 / B.16 'SDC in HBM'; B.8 vllm-project/vllm#54363 (bit rot in a tier)",
        mechanism="between two steps, the sign bit of the largest key element of one cached token in one layer flips",
        model="dense",
        expected=Expect.MISS,
        check="none",
        why_miss="the checks compare token, position and link records, never the KV bytes; a flipped bit under a "
        "correct record needs the KV digest",
    )

    def install(self, ctx: FaultContext) -> None:
        alloc = ctx.allocator(FULL)
        if alloc is None:
            return
        g = ctx.group_index(FULL)

        def before_forward(kwargs: dict[str, Any]) -> None:
            host = ctx.host
            if host is None:
                return
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
    spec = FaultSpec(
        name="padding-write-live-slot",
        bug_class="a padding write into a live slot",
        catalogue="B.10 vllm-project/vllm#43810 (padding slot id -1 overwrote slot 79), vllm-project/vllm#39444 "
        "(dummy run writes into block 0)",
        mechanism="one step's write list carries an extra padding entry that points at a live slot of another "
        "request instead of the write trash; every layer writes the padding row's K/V there",
        model="dense",
        expected=Expect.MISS,
        check="none",
        why_miss="padding entries belong to no request row, so the canary stamps nothing for them: the victim's "
        "record stays right while its bytes are overwritten; needs the KV digest",
    )

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
