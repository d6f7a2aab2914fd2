"""A tiny sglang-style scheduler over sglang 0.5.23's real components, for the canary's tests.

Real: ``ReqToTokenPool``, ``MHATokenToKVPool`` / ``SWAKVPool``, ``TokenToKVPoolAllocator`` /
``PagedTokenToKVPoolAllocator`` / ``SWATokenToKVPoolAllocator``, ``RadixCache``, ``ForwardBatch``,
``ForwardMode``, ``RadixAttention`` and ``TorchNativeAttnBackend`` (which writes the KV through the
pool's ``set_kv_buffer`` and reads it back through ``req_to_token``).  Ours: the scheduling loop
(admission with radix prefix match, chunked prefill, decode, finish with radix insert, eviction) that
sglang's ``Scheduler`` would run, and a two-layer model with random weights.  ``TinyRunner`` mirrors
the ``ModelRunner`` attributes the adapter reads.

torch-native reads sliding-window layers with untranslated full-pool indices (it has no SWA read
path), so in the SWA engine the window layer only writes (``set_kv_buffer`` with the translated
location, as the backend computes it); its reads are what the canary models.
"""

from __future__ import annotations

import dataclasses

import torch
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang_model import (
    DTYPE,
    HEAD_DIM,
    HEADS,
    VOCAB,
    TinyModel,
    TinyRunner,
    i64,
    make_forward_batch,
    server_args,
)


@dataclasses.dataclass
class Req:
    rid: str
    tokens: list[int]  # prompt, then generated tokens
    prompt_len: int
    max_new: int
    row: int = -1
    cached: int = 0  # tokens whose KV is in the pool (the row's seq_len)
    protected: int = 0  # leading tokens owned by the radix tree (matched at admission)
    node: object = None
    swa_evicted: int = 0  # window engine: positions below this have no window slot

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def done(self) -> bool:
        return self.cached >= self.prompt_len and self.generated >= self.max_new


def next_token(req: Req) -> int:
    return (sum(req.tokens[-3:]) * 31 + len(req.tokens) * 7 + 3) % VOCAB


FEATURES = (
    "radix_hits", "chunked_extends", "decode_steps", "extend_steps", "reused_slots", "swa_evictions",
    "swa_reused_slots", "swa_nonidentity", "evictions",
)  # fmt: skip


def _pools(
    page_size: int, pool_size: int, swa_size: int, window: int | None, model: torch.nn.Module | None
) -> tuple[object, object, torch.nn.Module]:
    """(KV pool, its allocator, the model): a full-attention pool (token or paged allocator), or with a
    window an SWA pool whose layer 1 slides (the model then always the tiny windowed one)."""
    if window is None:
        pool = MHATokenToKVPool(
            pool_size, page_size, DTYPE, HEADS, HEAD_DIM, layer_num=2, device="cpu", enable_memory_saver=False
        )
        if page_size == 1:
            alloc = TokenToKVPoolAllocator(pool_size, DTYPE, "cpu", pool, need_sort=False)
        else:
            alloc = PagedTokenToKVPoolAllocator(pool_size, page_size, DTYPE, "cpu", pool, need_sort=False)
        return pool, alloc, model if model is not None else TinyModel()
    pool = SWAKVPool(
        pool_size, swa_size, page_size, DTYPE, HEADS, HEAD_DIM, swa_attention_layer_ids=[1],
        full_attention_layer_ids=[0], device="cpu",
    )  # fmt: skip
    alloc = SWATokenToKVPoolAllocator(pool_size, swa_size, page_size, DTYPE, "cpu", kvcache=pool, need_sort=False)
    return pool, alloc, TinyModel(window_layers=(1,), window=window)


class Engine:
    """Scheduler loop over real sglang pools; one ``step()`` = one forward (extend or decode)."""

    def __init__(
        self,
        *,
        page_size: int = 1,
        pool_size: int = 96,
        rows: int = 6,
        max_context: int = 64,
        chunk: int = 16,
        window: int | None = None,
        swa_size: int = 40,
        radix: bool = True,
        mode: str = "raise",
        server_kw: dict | None = None,
        model: torch.nn.Module | None = None,
        init_finished: bool = True,
        truth: bool = True,
    ) -> None:
        from kvcanary.adapters.sglang import install_canary

        self.page_size = page_size
        self.chunk = chunk
        self.window = window
        self.truth = truth  # pass each request's token ids as sglang's init_new snapshots them
        self.rtp = ReqToTokenPool(size=rows, max_context_len=max_context, device="cpu", enable_memory_saver=False)
        self.pool, self.alloc, model = _pools(page_size, pool_size, swa_size, window, model)
        self.tree = (
            RadixCache(
                CacheInitParams(
                    disable=False,
                    req_to_token_pool=self.rtp,
                    token_to_kv_pool_allocator=self.alloc,
                    page_size=page_size,
                )
            )
            if radix
            else None
        )
        sa = server_args(kv_canary=mode, chunked_prefill_size=chunk, **(server_kw or {}))
        self.runner = TinyRunner(self.rtp, self.pool, model, sa, sliding_window_size=window)
        self.reports: list = []
        self.failed: list[str] = []
        self.canary = install_canary(self.runner, on_fail_request=self._on_fail)
        if self.canary is not None and init_finished:
            self.canary.mark_init_finished()
        self.waiting: list[Req] = []
        self.running: list[Req] = []  # admitted; prefilling or decoding
        self.finished: list[Req] = []
        self.features = dict.fromkeys(FEATURES, 0)
        self._ever_allocated: set[int] = set()
        self._ever_swa: set[int] = set()

    def _on_fail(self, rids: list[object], report: object) -> None:
        self.failed.extend(str(r) for r in rids)

    # ------------------------------------------------------------------ admission and allocation

    def submit(self, rid: str, prompt: list[int], max_new: int) -> Req:
        req = Req(rid, list(prompt), len(prompt), max_new)
        self.waiting.append(req)
        return req

    def _admit(self, req: Req) -> None:
        rows = self.rtp.alloc_rows(1)
        assert rows is not None, "no free req_to_token row"
        req.row = rows[0]
        if self.tree is not None:
            m = self.tree.match_prefix(MatchPrefixParams(key=RadixKey(req.tokens[: req.prompt_len - 1])))
            n = m.device_prefix_len
            if n > 0:
                self.tree.inc_lock_ref(m.last_device_node)
                req.node = m.last_device_node
                idx = self.tree.path_device_indices(m.last_device_node)[:n]
                self.rtp.write((req.row, slice(0, n)), idx.to(torch.int32))
                self.features["radix_hits"] += 1
            req.cached = req.protected = n
        self.running.append(req)

    def _alloc(self, prefix: list[int], seq: list[int], rows: list[int], n: int) -> torch.Tensor:
        for attempt in range(2):
            if self.page_size == 1:
                out = self.alloc.alloc(n)
            else:
                table = self.rtp.req_to_token
                last = [int(table[r, p - 1]) if p > 0 else -1 for r, p in zip(rows, prefix, strict=True)]
                if all(s == p + 1 for s, p in zip(seq, prefix, strict=True)) and all(p > 0 for p in prefix):
                    out = self.alloc.alloc_decode(i64(seq), i64(seq), i64(last))
                else:
                    out = self.alloc.alloc_extend(i64(prefix), i64(prefix), i64(seq), i64(seq), i64(last), n)
            if out is not None:
                break
            assert self.tree is not None and attempt == 0, "KV pool exhausted"
            self.tree.evict(EvictParams(num_tokens=n + self.page_size))
            self.features["evictions"] += 1
        slots = out.tolist()
        self.features["reused_slots"] += sum(1 for s in slots if s in self._ever_allocated)
        self._ever_allocated.update(slots)
        return out

    # ------------------------------------------------------------------ one forward

    def step(self) -> bool:
        """Run one forward; False when there is nothing left to do."""
        while self.waiting and self.rtp.available_size() > 0:
            self._admit(self.waiting.pop(0))
        prefill = [r for r in self.running if r.cached < r.prompt_len]
        if prefill:
            self._extend(prefill)
        elif self.running:
            self._decode(self.running)
        else:
            return False
        self._finish()
        return True

    def run(self, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if not self.step():
                break
        if self.canary is not None:
            self.canary.flush()

    def _forward(self, fb: ForwardBatch) -> None:
        self.runner.forward(fb)

    def _extend(self, reqs: list[Req]) -> None:
        budget = self.chunk
        batch, prefix, extend = [], [], []
        for r in reqs:
            if budget <= 0:
                break
            n = min(r.prompt_len - r.cached, budget)
            budget -= n
            batch.append(r)
            prefix.append(r.cached)
            extend.append(n)
            if n < r.prompt_len - r.cached or r.cached > r.protected:
                self.features["chunked_extends"] += 1
        rows = [r.row for r in batch]
        seq = [p + e for p, e in zip(prefix, extend, strict=True)]
        loc = self._alloc(prefix, seq, rows, sum(extend))
        off = 0
        ids, pos = [], []
        for r, p, e in zip(batch, prefix, extend, strict=True):
            self.rtp.write((r.row, slice(p, p + e)), loc[off : off + e].to(torch.int32))
            ids += r.tokens[p : p + e]
            pos += range(p, p + e)
            off += e
        truth = [list(r.tokens) for r in batch] if self.truth else None
        fb = make_forward_batch(
            ForwardMode.EXTEND, rows, prefix, extend, ids, pos, loc, [r.rid for r in batch], truth=truth
        )
        self._forward(fb)
        self.features["extend_steps"] += 1
        for r, e in zip(batch, extend, strict=True):
            r.cached += e
            if r.cached == r.prompt_len:
                r.tokens.append(next_token(r))
        self._after_forward(batch)

    def _decode(self, reqs: list[Req]) -> None:
        rows = [r.row for r in reqs]
        prefix = [r.cached for r in reqs]
        seq = [p + 1 for p in prefix]
        loc = self._alloc(prefix, seq, rows, len(reqs))
        for r, s in zip(reqs, loc.tolist(), strict=True):
            self.rtp.req_to_token[r.row, r.cached] = s
        ids = [r.tokens[r.cached] for r in reqs]
        rids = [r.rid for r in reqs]
        truth = [list(r.tokens) for r in reqs] if self.truth else None
        fb = make_forward_batch(ForwardMode.DECODE, rows, prefix, [1] * len(reqs), ids, prefix, loc, rids, truth=truth)
        self._forward(fb)
        self.features["decode_steps"] += 1
        for r in reqs:
            r.cached += 1
            r.tokens.append(next_token(r))
        self._after_forward(reqs)

    def _after_forward(self, reqs: list[Req]) -> None:
        if self.window is None:
            return
        mapping = self.alloc.full_to_swa_index_mapping
        for r in reqs:
            keep_from = max(0, r.cached - self.window)  # positions the next forward reads
            if keep_from > r.swa_evicted:
                full = self.rtp.req_to_token[r.row, r.swa_evicted : keep_from].to(torch.int64)
                self.alloc.free_swa(full)
                self.features["swa_evictions"] += int(full.numel())
                r.swa_evicted = keep_from
            live = self.rtp.req_to_token[r.row, r.swa_evicted : r.cached].to(torch.int64)
            swa = mapping[live]
            self.features["swa_nonidentity"] += int((swa != live).sum())
            new = set(swa.tolist()) - {0}
            self.features["swa_reused_slots"] += len(new & self._ever_swa)
            self._ever_swa |= new

    def _finish(self) -> None:
        for r in [r for r in self.running if r.done]:
            self.running.remove(r)
            self.finished.append(r)
            self.release(r)

    def release(self, r: Req) -> None:
        """sglang's cache_finished_req: insert into the tree, free duplicates and the unaligned tail."""
        kv = self.rtp.req_to_token[r.row, : r.cached].to(torch.int64).clone()
        if self.window is not None:
            mapped = kv[r.swa_evicted :]
            self.alloc.free_swa(mapped)
            self.alloc.free_full(kv)
        elif self.tree is not None:
            aligned = r.cached // self.page_size * self.page_size
            res = self.tree.insert(InsertParams(key=RadixKey(r.tokens[:aligned]), value=kv[:aligned]))
            self.alloc.free(kv[r.protected : res.prefix_len])
            self.alloc.free(kv[aligned:])
            if r.node is not None:
                self.tree.dec_lock_ref(r.node)
        else:
            self.alloc.free(kv)
        self.rtp.free_rows([r.row])
