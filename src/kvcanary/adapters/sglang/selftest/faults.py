"""sglang's fault library: corruptions of sglang's own scheduler state, the way real bugs corrupted it.

Each fault acts on the live ``Scheduler`` through :class:`~.context.SglangInjector`'s two hook points and
never touches the canary.  Probe runs only record where each fault *could* strike (its eligible steps).
"""

from __future__ import annotations

from array import array
from typing import Any

import torch

from kvcanary.adapters.sglang.selftest.context import SglangInjector
from kvcanary.selftest.protocol import Fault
from kvcanary.selftest.specs import load_specs

WORKLOAD = "llama"
SPECS, _ = load_specs(__package__)  # faults.toml: each fault's spec, as data


def _rows(batch: Any) -> list[int]:
    return [int(r) for r in batch.req_pool_indices.tolist()]


def _prefix_lens(batch: Any) -> list[int]:
    """Tokens each row already holds in the pool before this forward (what attention reads besides the new)."""
    if batch.forward_mode.is_extend():
        lens = list(batch.prefix_lens)
        return lens + [int(s) - 1 for s in batch.seq_lens_cpu.tolist()[len(lens) :]]
    return [int(s) - 1 for s in batch.seq_lens_cpu.tolist()]


def _live_reader(ctx: SglangInjector, batch: Any) -> tuple[int, int] | None:
    """(batch row, a cached position it reads) drawn from the rows with a prefix in the pool, or None."""
    readers = [i for i, p in enumerate(_prefix_lens(batch)[: len(batch.reqs)]) if p > 0]
    if not readers:
        return None
    i = ctx.rng.choice(readers)
    return i, ctx.rng.randrange(_prefix_lens(batch)[i])


class ReqToTokenForeign(Fault[SglangInjector]):
    """One ``req_to_token`` entry of a request points into another request's slot (sglang#25015-style index
    bug: the row of a neighbour in the batch)."""

    spec = SPECS["req-to-token-foreign"]

    def install(self, ctx: SglangInjector) -> None:
        ctx.before_forward_hooks.append(lambda batch: self._strike(ctx, batch))

    def _strike(self, ctx: SglangInjector, batch: Any) -> None:
        rows, prefix = _rows(batch), _prefix_lens(batch)
        if len(rows) < 2 or min(prefix[:2]) < 4 or not ctx.take(self.name):
            return
        pos = ctx.rng.randrange(1, prefix[0])
        other = ctx.rng.randrange(0, prefix[1])
        victim = int(ctx.table[rows[0], pos])
        foreign = int(ctx.table[rows[1], other])
        if foreign == victim:
            return
        ctx.table[rows[0], pos] = foreign
        ctx.injected(f"req_to_token[{rows[0]}, {pos}]: slot {victim} -> {foreign}", [batch.reqs[0].rid])


class RadixNodeStale(Fault[SglangInjector]):
    """A radix-cache node keeps its slots after they were freed and handed out again (sglang#38319-style:
    the tree still serves a prefix whose KV was released)."""

    spec = SPECS["radix-node-stale"]

    def install(self, ctx: SglangInjector) -> None:
        ctx.after_step_hooks.append(lambda: self._strike(ctx))

    def _strike(self, ctx: SglangInjector) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        if ctx.loop.pending_arrivals == 0 and not ctx.scheduler.waiting_queue:
            return  # nobody left to hit the prefix: the corruption could not reach a read
        tree = ctx.scheduler.tree_cache
        seen = sorted(ctx.loop.requests.values(), key=lambda r: r.rid)
        for req in seen:
            match = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", req.origin_input_ids))))
            n = match.device_prefix_len
            if n >= 8:
                break
        else:
            return
        if not ctx.take(self.name):
            return
        slots = tree.path_device_indices(match.last_device_node)[:n]
        start = ctx.rng.randrange(0, n - 4)
        freed = slots[start : start + 4].clone()
        ctx.scheduler.token_to_kv_pool_allocator.free(freed)
        ctx.injected(f"radix prefix of {req.rid}: slots {freed.tolist()} freed, still in the tree", [req.rid])


class OutCacheLocOffByOne(Fault[SglangInjector]):
    """The write locations of a forward are off by one from the ``req_to_token`` entries (the KV of position p
    lands in the slot after the one the table gives it; sglang#26329 / #28254-style output-region bugs)."""

    spec = SPECS["out-cache-loc-off-by-one"]

    def install(self, ctx: SglangInjector) -> None:
        ctx.before_forward_hooks.append(lambda batch: self._strike(ctx, batch))

    def _strike(self, ctx: SglangInjector, batch: Any) -> None:
        loc = batch.out_cache_loc
        slots = int(ctx.loop.runner.token_to_kv_pool.size)  # the last usable slot is `size`
        if loc is None or loc.numel() == 0 or int(loc.max()) >= slots or not ctx.take(self.name):
            return
        loc.add_(1)
        ctx.injected(f"out_cache_loc +1 for {loc.numel()} tokens", [r.rid for r in batch.reqs])


class ResumeOntoStaleSlots(Fault[SglangInjector]):
    """A request retracted under memory pressure resumes with its ``req_to_token`` row pointing at the slots it
    held before the retraction, which were freed and handed to others (sglang#28254-style resume bug)."""

    spec = SPECS["resume-onto-stale-slots"]

    def __init__(self) -> None:
        self.held: dict[str, list[int]] = {}

    def install(self, ctx: SglangInjector) -> None:
        ctx.before_forward_hooks.append(lambda batch: self._strike(ctx, batch))

    def _strike(self, ctx: SglangInjector, batch: Any) -> None:
        rows = _rows(batch)
        seq = [int(s) for s in batch.seq_lens_cpu.tolist()]
        extending = batch.forward_mode.is_extend()
        for i, req in enumerate(batch.reqs):
            if extending and req.retraction_count > 0 and req.rid in self.held and i < len(batch.extend_lens):
                self._resume(ctx, req, rows[i], seq[i])
                continue
            self.held[req.rid] = ctx.table[rows[i], : seq[i]].tolist()

    def _resume(self, ctx: SglangInjector, req: Any, row: int, seq: int) -> None:
        stale = self.held.pop(req.rid)
        n = min(len(stale), seq)
        alloc = ctx.scheduler.token_to_kv_pool_allocator
        free = set(alloc.free_pages.tolist()) | set(alloc.release_pages.tolist())
        current = set(ctx.table[row, :n].tolist())
        reused = [s for s in stale[:n] if s not in free and s not in current]
        if not reused or not ctx.take(self.name):
            return
        ctx.table[row, :n] = ctx.table.new_tensor(stale[:n])
        ctx.injected(f"resumed {req.rid} onto its {n} pre-retraction slots ({len(reused)} reused)", [req.rid])


class WrongTokenInIds(Fault[SglangInjector]):
    """A request's token ids disagree with what was computed: the latest sampled token in ``output_ids`` is
    replaced after its KV-producing token was scheduled (upstream's next-token swap perturbation)."""

    spec = SPECS["wrong-token-in-ids"]

    def install(self, ctx: SglangInjector) -> None:
        ctx.after_step_hooks.append(lambda: self._strike(ctx))

    def _strike(self, ctx: SglangInjector) -> None:
        running = [r for r in ctx.scheduler.running_batch.reqs if len(r.output_ids) > 0 and not r.finished()]
        if not running or not ctx.take(self.name):
            return
        req = ctx.rng.choice(running)
        old = req.output_ids[-1]
        req.output_ids[-1] = (old - 3 + 1 + ctx.rng.randrange(100)) % 120 + 3  # never old: 1..100 away mod 120
        ctx.injected(f"{req.rid} output_ids[-1]: {old} -> {req.output_ids[-1]}", [req.rid])


class KVBitFlip(Fault[SglangInjector]):
    """One bit of a cached token's K flips in the pool (HBM/DRAM bit error, a stray DMA): every record and
    table entry stays correct, only the KV digest (run at budget 1.0 here) can see it."""

    spec = SPECS["kv-bit-flip"]

    def install(self, ctx: SglangInjector) -> None:
        ctx.before_forward_hooks.append(lambda batch: self._strike(ctx, batch))

    def _strike(self, ctx: SglangInjector, batch: Any) -> None:
        pick = _live_reader(ctx, batch)
        if pick is None or not ctx.take(self.name):
            return
        i, pos = pick
        slot = int(ctx.table[_rows(batch)[i], pos])
        pool = ctx.loop.runner.token_to_kv_pool
        layer = ctx.rng.randrange(int(pool.layer_num))
        flat = pool.k_buffer[layer][slot].view(-1)
        j = int(flat.abs().argmax())
        flat.view(torch.int32)[j] ^= -(2**31)  # the float32 sign bit
        ctx.injected(f"sign bit of K[{j}] of slot {slot} ({batch.reqs[i].rid} position {pos}), layer {layer}",
                     [batch.reqs[i].rid])  # fmt: skip


class PaddingWriteLiveSlot(Fault[SglangInjector]):
    """A forward's ``set_kv_buffer`` also writes its last token's K/V into a live slot of a request in the
    batch (a padded row whose write location was not redirected to the padding slot): the records still say
    the slot holds its own token; only its bytes changed."""

    spec = SPECS["padding-write-live-slot"]

    def install(self, ctx: SglangInjector) -> None:
        victim: dict[int, int] = {}  # step -> the live slot the stray write lands on
        ctx.before_forward_hooks.append(lambda batch: self._pick(ctx, batch, victim))
        pool = ctx.loop.runner.token_to_kv_pool

        def make(inner: Any) -> Any:
            def set_kv_buffer(layer: Any, loc: Any, cache_k: Any, cache_v: Any, *args: Any, **kwargs: Any) -> Any:
                out = inner(layer, loc, cache_k, cache_v, *args, **kwargs)
                slot = victim.get(ctx.step)
                if slot is not None and cache_k is not None and cache_k.shape[0] > 0:
                    where = torch.tensor([slot], dtype=torch.int64, device=cache_k.device)
                    inner(layer, where, cache_k[-1:], cache_v[-1:], *args, **kwargs)
                return out

            return set_kv_buffer

        ctx.wrap(pool, "set_kv_buffer", make)

    def _pick(self, ctx: SglangInjector, batch: Any, victim: dict[int, int]) -> None:
        pick = _live_reader(ctx, batch)
        if pick is None or not ctx.take(self.name):
            return
        i, pos = pick
        victim[ctx.step] = int(ctx.table[_rows(batch)[i], pos])
        ctx.injected(f"the last K/V row of the forward also written into {batch.reqs[i].rid}'s position {pos} "
                     f"(slot {victim[ctx.step]})", [batch.reqs[i].rid])  # fmt: skip


FAULTS: dict[str, type[Fault[Any]]] = {
    f.spec.name: f
    for f in (
        ReqToTokenForeign,
        RadixNodeStale,
        OutCacheLocOffByOne,
        ResumeOntoStaleSlots,
        WrongTokenInIds,
        KVBitFlip,
        PaddingWriteLiveSlot,
    )
}
