"""One batch's attention metadata as each vLLM 0.32 GPU backend builds it, on the CPU (for ``test_metadata.py``).

``FLASH_ATTN``, ``TRITON_ATTN`` and ``FLEX_ATTENTION``: their own metadata builders (vLLM's classes with a real
``VllmConfig`` of the tiny test model) build from one ``CommonAttentionMetadata``.  ``FLASHINFER``'s module
imports the GPU-only ``flashinfer`` package; where that is missing, its metadata dataclasses and its builder's
decode query-length rule (``_compute_decode_query_lens``) are compiled from the installed vLLM's own source
(the ``ast`` of ``flashinfer.py``, nothing copied), and the TRTLLM-path metadata is assembled from the common
metadata the way its ``build`` slices it: decodes first (vLLM's ``split_decodes_and_prefills``), then prefills.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import importlib.util
import pathlib
import types
from collections.abc import Sequence
from typing import Any

import torch

LAYER = "model.layers.0.self_attn.attn"
DENSE_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION")
FLASHINFER_CLASSES = (
    "FIPrefill", "FIDecode", "FlashInferDecodeKernel", "TRTLLMPrefill", "FlashInferTrtllmAPIDecode",
    "FlashInferMetadata",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Batch:
    """A step: row r has ``prefix[r]`` cached tokens and schedules ``extend[r]``; pages of ``page`` tokens."""

    prefix: tuple[int, ...]
    extend: tuple[int, ...]
    page: int

    def pages(self, r: int) -> int:
        return -(-(self.prefix[r] + self.extend[r]) // self.page)


def common_metadata(batch: Batch, seed: int = 0) -> Any:
    """The runner's ``CommonAttentionMetadata`` of ``batch``: distinct random blocks per row (block 0, the null
    block, never), one spare table column of random blocks past the longest row, slots of the scheduled tokens."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    gen = torch.Generator().manual_seed(seed)
    n = len(batch.prefix)
    width = max(batch.pages(r) for r in range(n)) + 1
    blocks = 1 + torch.randperm(n * width + 7, generator=gen)[: n * width]
    table = blocks.view(n, width).to(torch.int32)
    seq = torch.tensor([p + e for p, e in zip(batch.prefix, batch.extend, strict=True)], dtype=torch.int32)
    qsl = torch.zeros(n + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(batch.extend), 0)
    slots = [
        int(table[r, pos // batch.page]) * batch.page + pos % batch.page
        for r in range(n)
        for pos in range(batch.prefix[r], batch.prefix[r] + batch.extend[r])
    ]
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq, num_reqs=n,
        num_actual_tokens=int(qsl[-1]), max_query_len=max(batch.extend), max_seq_len=int(seq.max()),
        block_table_tensor=table, slot_mapping=torch.tensor(slots, dtype=torch.int64),
        seq_lens_cpu_upper_bound=seq.clone(),
    )  # fmt: skip


def vllm_config(model_dir: str) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    from kvcanary.adapters.vllm import tiny

    config = EngineArgs(model=model_dir, **tiny.engine_kwargs()).create_engine_config()
    config.cache_config.num_gpu_blocks = 1024  # FlexAttention's inverse block table spans the pool
    return config


def dense_metadata(name: str, config: Any, common: Any, page: int) -> Any:
    """``name``'s metadata of the batch, built by its own metadata builder on the CPU."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=page, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    with set_current_vllm_config(config):
        builder = AttentionBackendEnum[name].get_class().get_builder_cls()(spec, [LAYER], config, torch.device("cpu"))
        return builder.build(0, common)


@functools.cache
def flashinfer_source() -> types.SimpleNamespace:
    """FLASHINFER's metadata classes and its decode query-length rule: the real module where ``flashinfer`` is
    installed, else those definitions compiled from the installed vLLM's source."""
    if importlib.util.find_spec("flashinfer") is not None:
        from vllm.v1.attention.backends import flashinfer as fi

        rule = fi.FlashInferMetadataBuilder._compute_decode_query_lens
        return types.SimpleNamespace(**{c: getattr(fi, c) for c in FLASHINFER_CLASSES}, decode_query_lens=rule)
    from vllm.v1.kv_cache_layout import KVCacheLayout

    spec = importlib.util.find_spec("vllm.v1.attention.backends.flashinfer")
    assert spec is not None and spec.origin is not None
    tree = ast.parse(pathlib.Path(spec.origin).read_text())
    nodes: list[ast.stmt] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in FLASHINFER_CLASSES]
    builder = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "FlashInferMetadataBuilder")
    nodes += [n for n in builder.body if isinstance(n, ast.FunctionDef) and n.name == "_compute_decode_query_lens"]
    assert len(nodes) == len(FLASHINFER_CLASSES) + 1, [getattr(n, "name", "?") for n in nodes]
    wrappers = {w: type(w, (), {}) for w in ("BatchPrefillWithPagedKVCacheWrapper", "BatchDCPPrefillWrapper",
                                              "BatchDecodeWithPagedKVCacheWrapper")}  # fmt: skip
    scope: dict[str, Any] = dict(torch=torch, dataclass=dataclasses.dataclass, Enum=enum.Enum, **wrappers)
    scope["KVCacheLayout"] = KVCacheLayout
    exec(compile(ast.Module(body=nodes, type_ignores=[]), spec.origin, "exec"), scope)
    return types.SimpleNamespace(**{c: scope[c] for c in FLASHINFER_CLASSES}, decode_query_lens=scope[nodes[-1].name])


def flashinfer_metadata(
    common: Any, page: int, *, threshold: int = 1, decode_kernel: str = "XQA", fp8: bool = False
) -> Any:
    """FLASHINFER's metadata of the batch when both parts take the TRTLLM paths (``decode_kernel`` XQA, or
    TRTLLM_GEN with adaptive verification: the varlen decode); ``fp8`` cuts the prefill table as its build does."""
    from vllm.v1.attention.backends.utils import split_decodes_and_prefills
    from vllm.v1.kv_cache_layout import KVCacheLayout

    fi = flashinfer_source()
    xqa, varlen = decode_kernel == "XQA", decode_kernel == "TRTLLM_GEN"
    nd, np_, ndt, npt = split_decodes_and_prefills(common, decode_threshold=threshold, require_uniform=not xqa)
    qsl, seq, table = common.query_start_loc, common.seq_lens, common.block_table_tensor
    decode = prefill = None
    if nd > 0:
        rule = types.SimpleNamespace(use_xqa=xqa)
        q_len, q_cu, _ = fi.decode_query_lens(rule, qsl, common.query_start_loc_cpu, nd, ndt)
        if varlen:
            q_len, q_cu = min(common.max_query_len, threshold), qsl[: nd + 1]
        decode = fi.FlashInferTrtllmAPIDecode(
            kernel=fi.FlashInferDecodeKernel[decode_kernel], block_tables=table[:nd], seq_lens=seq[:nd],
            max_seq_len=common.max_seq_len, q_len_per_req=q_len, q_cu_seq_lens=q_cu,
        )  # fmt: skip
    if np_ > 0:
        prefill_table = table[nd:]
        if fp8:
            prefill_table = prefill_table[:, : -(-int(seq[nd:].max()) // page)].contiguous()
        starts = qsl[nd:] - qsl[nd]
        prefill = fi.TRTLLMPrefill(
            block_tables=prefill_table, seq_lens=seq[nd:], cum_seq_lens_q=starts, cum_seq_lens_kv=None,
            max_q_len=int((starts[1:] - starts[:-1]).max()), max_seq_len=common.max_seq_len,
        )  # fmt: skip
    return fi.FlashInferMetadata(
        kv_cache_layout=next(iter(KVCacheLayout)), num_actual_tokens=common.num_actual_tokens,
        slot_mapping=common.slot_mapping, q_data_type_prefill=torch.bfloat16, q_data_type_decode=torch.bfloat16,
        num_decodes=nd, num_decode_tokens=ndt, num_prefills=np_, num_prefill_tokens=npt, causal=True,
        prefill=prefill, decode=decode,
    )  # fmt: skip


def needed_pages(table: torch.Tensor, seq_lens: Sequence[int], page: int) -> list[list[int]]:
    """Each row's table entries that attention reads (the pages its sequence spans)."""
    return [table[r, : -(-int(s) // page)].tolist() for r, s in enumerate(seq_lens)]
