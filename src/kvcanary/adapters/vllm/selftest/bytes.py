"""vLLM faults in the KV bytes themselves: every record, table entry and slot mapping stays correct.

Only the KV digest sees them (the self-test runs it at budget 1.0, ``docs/design.md`` §12): a slot's bytes
no longer match the digest stamped after the forward that wrote them, or that moved in with its record.
They act on vLLM's own cache tensors (``runner.kv_caches``: per layer ``[blocks, heads, block_size,
2 * head_size]``, K transposed per block, then V token-major) and its own write and copy paths.
"""

from __future__ import annotations

from typing import Any

import torch

from kvcanary.adapters.vllm.selftest.context import RunnerFault, VllmInjector, decode_rows
from kvcanary.selftest.protocol import Fault
from kvcanary.selftest.specs import load_specs

SPECS, _ = load_specs(__package__)  # faults.toml: each fault's spec, as data


def flip_k_sign(kv: torch.Tensor, block: int, offset: int) -> int:
    """Flip the float32 sign bit of the largest-magnitude K element of slot (block, offset), head 0."""
    _nb, _heads, bs, two_hd = kv.shape
    k = kv[block, 0].reshape(-1)[: bs * (two_hd // 2)].view(two_hd // 2, bs)[:, offset]  # K: [head_size, bs]
    j = int(k.abs().argmax())
    k[j : j + 1].view(torch.int32).bitwise_xor_(-(2**31))
    return j


LivePosition = tuple[str, int, int, int]  # request, position, kernel block, offset


def _live_position(ctx: VllmInjector, so: Any) -> LivePosition | None:
    """(request, position, kernel block, offset) of a cached position of a decoding request, drawn."""
    rows = decode_rows(ctx, so)
    if not rows:
        return None
    row, rid = ctx.rng.choice(rows)
    pos = ctx.rng.randrange(ctx.runner.requests[rid].num_computed_tokens)
    table = ctx.runner.input_batch.block_table.block_tables[0]
    bs = int(table.block_size)
    return rid, pos, int(table.block_table.np[row, pos // bs]), pos % bs


class KVBitFlip(RunnerFault):
    spec = SPECS["kv_bit_flip"]
    method = "_update_states"
    after = True

    def _eligible(self, ctx: VllmInjector, so: Any) -> LivePosition | None:
        return _live_position(ctx, so)  # drawn at every opportunity, taken or not

    def _corrupt(self, ctx: VllmInjector, so: Any, pick: LivePosition) -> None:
        rid, pos, block, offset = pick
        layer = ctx.rng.randrange(len(ctx.runner.kv_caches))
        j = flip_k_sign(ctx.runner.kv_caches[layer], block, offset)
        ctx.injected(f"{rid} position {pos}: sign bit of K[{j}] flipped in layer {layer}", [rid])


class PaddingWriteLiveSlot(RunnerFault):
    spec = SPECS["padding_write_live_slot"]
    method = "_update_states"
    after = True

    def __init__(self) -> None:
        self.victim: int | None = None  # the live slot the next forward's layers also write
        self.layers_written: set[str] = set()

    def install(self, ctx: VllmInjector) -> None:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

        super().install(ctx)  # the victim is picked after _update_states
        ctx.wrap(CPUAttentionBackendImpl, "do_kv_cache_update", lambda original: self._write(ctx, original))

    def _eligible(self, ctx: VllmInjector, so: Any) -> LivePosition | None:
        return _live_position(ctx, so)

    def _corrupt(self, ctx: VllmInjector, so: Any, pick: LivePosition) -> None:
        rid, pos, block, offset = pick
        bs = int(ctx.runner.input_batch.block_table.block_tables[0].block_size)
        self.victim, self.layers_written = block * bs + offset, set()
        ctx.injected(f"the step's last K/V row also written into {rid}'s position {pos} (slot {self.victim})", [rid])

    def _write(self, ctx: VllmInjector, original: Any) -> Any:
        def do_kv_cache_update(impl: Any, layer: Any, key: Any, value: Any, kv_cache: Any, slots: Any) -> Any:
            out = original(impl, layer, key, value, kv_cache, slots)
            if self.victim is not None and key is not None and key.shape[0] > 0:
                where = torch.tensor([self.victim], dtype=slots.dtype, device=slots.device)
                original(impl, layer, key[-1:], value[-1:], kv_cache, where)
                self.layers_written.add(str(layer.layer_name))
                if len(self.layers_written) >= len(ctx.runner.kv_caches):
                    self.victim = None  # one forward's worth of layers
            return out

        return do_kv_cache_update


class CowCopyCorruptsBytes(Fault[VllmInjector]):
    spec = SPECS["cow_copy_corrupts_bytes"]

    def install(self, ctx: VllmInjector) -> None:
        import vllm.v1.worker.gpu_model_runner as gmr

        ctx.wrap(gmr, "copy_kv_cache_blocks_inplace", lambda original: self._copy(ctx, original))

    def _copy(self, ctx: VllmInjector, original: Any) -> Any:
        def copy_kv_cache_blocks_inplace(kv_caches: Any, num_blocks: int, copies: Any, *a: Any, **k: Any) -> Any:
            out = original(kv_caches, num_blocks, copies, *a, **k)
            if copies and ctx.take(self.name):
                _src, dst = copies[0]
                owners = [rid for rid in ctx.runner.requests if int(dst) in ctx.runner.requests[rid].block_ids[0]]
                flip_k_sign(ctx.runner.kv_caches[0], int(dst), 0)
                ctx.injected(f"block {dst} of a copy-on-write copy damaged after the copy", owners)
            return out

        return copy_kv_cache_blocks_inplace
