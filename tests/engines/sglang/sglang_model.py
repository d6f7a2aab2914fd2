"""The tiny models and runner the sglang tests drive through sglang's real attention and pools.

``TinyModel`` (random weights, ``RadixAttention`` layers, some sliding-window), ``WriteOnlyModel`` (K/V
writes only, MHA or MLA), ``TinyRunner`` (the ``ModelRunner`` attributes the adapter reads) and
``make_forward_batch`` (a real ``ForwardBatch``); :mod:`sglang_harness` schedules requests over them.
"""

from __future__ import annotations

import types

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

VOCAB = 97
HEADS = 2
HEAD_DIM = 8
HIDDEN = HEADS * HEAD_DIM
DTYPE = torch.float32


class TinyModel(torch.nn.Module):
    """Embedding, then per layer q/k/v projections into a real RadixAttention; random weights."""

    def __init__(self, window_layers: tuple[int, ...] = (), window: int = -1, num_layers: int = 2) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=g))
        self.qkv = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(HIDDEN, 3 * HIDDEN, generator=g) / 4) for _ in range(num_layers)]
        )
        self.attn = torch.nn.ModuleList(
            [
                RadixAttention(
                    HEADS,
                    HEAD_DIM,
                    HEAD_DIM**-0.5,
                    HEADS,
                    layer_id=i,
                    sliding_window_size=window if i in window_layers else -1,
                )
                for i in range(num_layers)
            ]
        )
        self.window_layers = window_layers
        self.inner_calls = 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        h = self.embed[input_ids.long()] + positions.unsqueeze(1).to(DTYPE) / 64
        for i, attn in enumerate(self.attn):
            q, k, v = (h @ self.qkv[i]).split(HIDDEN, dim=1)
            if i in self.window_layers:
                backend = forward_batch.attn_backend_for_tests
                pool = backend.token_to_kv_pool
                pool.set_kv_buffer(
                    attn,
                    KVWriteLoc(forward_batch.out_cache_loc, backend.swa_out_cache_loc),
                    k.view(-1, HEADS, HEAD_DIM),
                    v.view(-1, HEADS, HEAD_DIM),
                )
                continue
            h = h + attn(q, k, v, forward_batch).view(-1, HIDDEN)
        return h


class WriteOnlyModel(torch.nn.Module):
    """Writes each layer's KV through the pool's real ``set_kv_buffer`` and reads nothing.

    For forwards torch-native cannot run (EAGLE target-verify: it takes ``seq_lens`` as the whole KV
    length) and pools it has no path for (MLA): the canary needs only the batch metadata.
    """

    def __init__(self, num_layers: int = 1, mla: bool = False) -> None:
        super().__init__()
        self.attn = torch.nn.ModuleList(
            [RadixAttention(HEADS, HEAD_DIM, 1.0, HEADS, layer_id=i) for i in range(num_layers)]
        )
        self.mla = mla

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        pool = forward_batch.attn_backend_for_tests.token_to_kv_pool
        n = int(input_ids.shape[0])
        for layer in self.attn:
            if self.mla:  # MLATokenToKVPool.set_kv_buffer needs sglang's parallel config: store directly
                pool.kv_buffer[layer.layer_id][forward_batch.out_cache_loc] = input_ids.to(DTYPE).view(-1, 1, 1)
            else:
                k = input_ids.to(DTYPE).view(-1, 1, 1).expand(n, HEADS, HEAD_DIM).contiguous()
                pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, k)
        return input_ids


class TinyRunner:
    """The ``ModelRunner`` surface the adapter uses: pools, server args, model, forward(forward_batch)."""

    def __init__(self, rtp, pool, model, server_args, *, sliding_window_size=None, is_draft_worker=False):
        self.device = "cpu"
        self.req_to_token_pool = rtp
        self.token_to_kv_pool = pool
        self.model = model
        self.server_args = server_args
        self.sliding_window_size = sliding_window_size
        self.is_draft_worker = is_draft_worker
        self.attn_backend = TorchNativeAttnBackend(self)
        self.forward_calls = 0

    def forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        self.forward_calls += 1
        self.attn_backend.init_forward_metadata(forward_batch)
        forward_batch.attn_backend_for_tests = self.attn_backend
        with torch.no_grad(), forward_context(ForwardContext(attn_backend=self.attn_backend)):
            return self.model(forward_batch.input_ids, forward_batch.positions, forward_batch)


def server_args(**kw: object) -> types.SimpleNamespace:
    base = {"kv_canary": "raise", "chunked_prefill_size": 16, "max_prefill_tokens": 64, "health_every": 0}
    base.update(kw)
    return types.SimpleNamespace(**base)


def i64(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


def make_forward_batch(
    mode: ForwardMode, rows, prefix, extend, ids, positions, loc, rids, *, truth=None, **extra
) -> ForwardBatch:
    """A real ForwardBatch as ``ForwardBatch.init_new`` would leave it for our fields.

    ``truth``: per batch row, the request's ``origin_input_ids + output_ids``, snapshotted as
    ``init_new`` does under ``SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT=1``.
    """
    if truth is not None:
        extra["req_all_ids_flat"] = torch.tensor([t for ids_ in truth for t in ids_], dtype=torch.int64)
        extra["req_all_ids_lens"] = torch.tensor([len(ids_) for ids_ in truth], dtype=torch.int64)
    seq = [p + e for p, e in zip(prefix, extend, strict=True)]
    fb = ForwardBatch(
        forward_mode=mode,
        batch_size=len(rows),
        input_ids=i64(ids),
        req_pool_indices=i64(rows),
        seq_lens=i64(seq),
        out_cache_loc=loc.to(torch.int64),
        seq_lens_sum=sum(seq),
        seq_lens_cpu=i64(seq),
        positions=i64(positions),
        rids=list(rids),
        **extra,
    )
    if mode in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DRAFT_EXTEND_V2):
        fb.extend_prefix_lens = torch.tensor(prefix, dtype=torch.int32)
        fb.extend_seq_lens = torch.tensor(extend, dtype=torch.int32)
        fb.extend_prefix_lens_cpu = list(prefix)
        fb.extend_seq_lens_cpu = list(extend)
        fb.extend_num_tokens = sum(extend)
        starts = [0]
        for e in extend[:-1]:
            starts.append(starts[-1] + e)
        fb.extend_start_loc = torch.tensor(starts, dtype=torch.int32)
    return fb
