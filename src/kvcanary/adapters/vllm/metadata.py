"""Where each vLLM 0.32 attention backend keeps a step's per-request rows, read into one shape (:class:`Rows`).

Every backend's metadata builder starts from the runner's ``CommonAttentionMetadata`` (rows in ``input_batch``
order, decodes first once the batch is reordered) and keeps what its kernels need:

==================  ==========================================================================================
backend             query starts, sequence lengths, block table, slot mapping
==================  ==========================================================================================
``CPU_ATTN``,       ``query_start_loc``, ``seq_lens``, ``block_table``, ``slot_mapping`` (:data:`DENSE_FIELDS`):
``FLASH_ATTN``,     the common metadata's own tensors.  ``FLEX_ATTENTION`` keeps ``query_start_loc`` and
``TRITON_ATTN``,    ``seq_lens`` in persistent buffers of the scheduler's capacity (``max_num_seqs`` rows), so
``FLEX_ATTENTION``  only the step's first ``num_reqs`` rows are read
``FLASHINFER``      no dense fields: ``slot_mapping`` and the counts ``num_decodes``/``num_prefills`` at the top,
                    the rows in two parts.  ``decode`` (rows ``[0, num_decodes)``) is a
                    ``FlashInferTrtllmAPIDecode`` (XQA / trtllm-gen): ``block_tables``, ``seq_lens`` and
                    either ``q_cu_seq_lens`` (ragged query starts) or ``q_len_per_req`` (every decode row
                    that many tokens).  ``prefill`` (the remaining rows) is a ``TRTLLMPrefill``:
                    ``block_tables``, ``seq_lens`` and ``cum_seq_lens_q`` (query starts from 0 at its first
                    row; with an fp8 cache its table is cut to the prefills' longest sequence).  Rows past
                    the step's requests (CUDA-graph padding) are cut
==================  ==========================================================================================

**Refused: FlashInfer's native paths.**  A ``FIPrefill`` or ``FIDecode`` part holds only ``wrapper``, a planned
``flashinfer`` wrapper: vLLM handed it ``qo_indptr``, ``paged_kv_indptr``/``paged_kv_indices``/
``paged_kv_last_page_len`` and kept none of them in the metadata, so it has no ``block_tables``, ``seq_lens``
or query starts to read.  Which path a step takes is the builder's choice: decodes go through the TRTLLM API
when ``use_trtllm_decode_attention`` is set at start-up, prefills per step unless TRTLLM is forced (page size
128 and up, or ``attention_config.use_trtllm_attention``) and the GPU runs TRTLLM prefill (SM100).
:func:`flashinfer_refusal` refuses at install an engine whose builder can take a native path; a step that takes
one anyway is a clear ``TypeError`` naming the part (a canary error: logged, never raised, in ``log`` mode).
Decode context parallelism (rank-local ``seq_lens``) is refused too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

DENSE_FIELDS = ("query_start_loc", "seq_lens", "block_table", "slot_mapping")
FLASHINFER_FIELDS = ("num_decodes", "num_prefills", "decode", "prefill", "slot_mapping")
FLASHINFER_DECODE_FIELDS = ("block_tables", "seq_lens", "q_len_per_req", "q_cu_seq_lens")
FLASHINFER_PREFILL_FIELDS = ("block_tables", "seq_lens", "cum_seq_lens_q")
FLASHINFER_BUILDER_FIELDS = ("use_dcp", "use_trtllm_decode_attention", "page_size", "attention_config")


@dataclasses.dataclass(frozen=True)
class Rows:
    """A step's rows as the metadata holds them: ``table[r]`` blocks, ``seq_lens[r]`` tokens after the step,
    ``extend_lens[r]`` scheduled this step, and the metadata's own slot mapping."""

    table: torch.Tensor
    seq_lens: torch.Tensor
    extend_lens: torch.Tensor
    slot_mapping: torch.Tensor


def int_tensor(value: object, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"vLLM {what} must be an int32/int64 tensor, got {value!r:.80}")
    return value


def read_rows(metadata: Any, num_reqs: int) -> Rows:
    """The first ``num_reqs`` rows of one layer's attention metadata, whichever backend built it."""
    if all(hasattr(metadata, f) for f in DENSE_FIELDS):
        return _dense_rows(metadata, num_reqs)
    if all(hasattr(metadata, f) for f in FLASHINFER_FIELDS):
        return _flashinfer_rows(metadata, num_reqs)
    raise TypeError(
        f"attention metadata {type(metadata).__name__} has neither {list(DENSE_FIELDS)} nor FLASHINFER's "
        f"{list(FLASHINFER_FIELDS)}: a layout the canary does not know"
    )


def _dense_rows(metadata: Any, num_reqs: int) -> Rows:
    qsl = int_tensor(metadata.query_start_loc, "query_start_loc")[: num_reqs + 1]
    seq = int_tensor(metadata.seq_lens, "seq_lens")[:num_reqs]
    table = int_tensor(metadata.block_table, "block_table")[:num_reqs]
    return Rows(table, seq, qsl[1:] - qsl[:-1], int_tensor(metadata.slot_mapping, "slot_mapping"))


def _flashinfer_rows(metadata: Any, num_reqs: int) -> Rows:
    num_decodes, num_prefills = int(metadata.num_decodes), int(metadata.num_prefills)
    if num_decodes + num_prefills < num_reqs:
        raise ValueError(
            f"vLLM FLASHINFER metadata has {num_decodes} decode + {num_prefills} prefill rows; "
            f"the step has {num_reqs} requests"
        )
    slots = int_tensor(metadata.slot_mapping, "FLASHINFER slot_mapping")
    if num_reqs == 0:
        empty = torch.zeros(0, dtype=torch.int32, device=slots.device)
        return Rows(empty.view(0, 0), empty, empty, slots)
    parts = []
    if num_decodes > 0:
        parts.append(_flashinfer_decode(metadata.decode, num_decodes))
    if num_prefills > 0:
        parts.append(_flashinfer_prefill(metadata.prefill, num_prefills))
    width = max(int(t.shape[1]) for t, _, _ in parts)
    # The fp8 prefill table is cut to its longest sequence: zero (the null block) pads it past what it reads.
    table = torch.cat([torch.nn.functional.pad(t, (0, width - int(t.shape[1]))) for t, _, _ in parts])
    seq = torch.cat([s.to(torch.int32) for _, s, _ in parts])
    extend = torch.cat([e.to(torch.int32) for _, _, e in parts])
    return Rows(table[:num_reqs], seq[:num_reqs], extend[:num_reqs], slots)


def _part(part: Any, fields: tuple[str, ...], name: str) -> Any:
    missing = [f for f in fields if not hasattr(part, f)]
    if missing:
        raise TypeError(
            f"vLLM FLASHINFER's {name} metadata is a {type(part).__name__} (flashinfer's native path), which "
            f"lacks {missing}: its rows live only in flashinfer's planned wrapper; the canary reads the TRTLLM "
            "paths (attention_config.use_trtllm_attention=1 on a GPU with TRTLLM prefill) or another backend"
        )
    return part


def _flashinfer_decode(part: Any, num_decodes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    part = _part(part, FLASHINFER_DECODE_FIELDS, "decode")
    table = int_tensor(part.block_tables, "FLASHINFER decode.block_tables")[:num_decodes]
    seq = int_tensor(part.seq_lens, "FLASHINFER decode.seq_lens")[:num_decodes]
    if part.q_cu_seq_lens is None:  # every decode row has q_len_per_req tokens
        extend = torch.full((num_decodes,), int(part.q_len_per_req), dtype=torch.int32, device=seq.device)
    else:
        starts = int_tensor(part.q_cu_seq_lens, "FLASHINFER decode.q_cu_seq_lens")[: num_decodes + 1]
        extend = starts[1:] - starts[:-1]
    return table, seq, extend


def _flashinfer_prefill(part: Any, num_prefills: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    part = _part(part, FLASHINFER_PREFILL_FIELDS, "prefill")
    table = int_tensor(part.block_tables, "FLASHINFER prefill.block_tables")[:num_prefills]
    seq = int_tensor(part.seq_lens, "FLASHINFER prefill.seq_lens")[:num_prefills]
    starts = int_tensor(part.cum_seq_lens_q, "FLASHINFER prefill.cum_seq_lens_q")[: num_prefills + 1]
    return table, seq, starts[1:] - starts[:-1]


def flashinfer_refusal(builder: Any) -> str | None:
    """Why a FLASHINFER metadata builder's steps may not be readable (None: every step takes TRTLLM paths)."""
    missing = [f for f in FLASHINFER_BUILDER_FIELDS if not hasattr(builder, f)]
    if missing:
        return f"its metadata builder {type(builder).__name__} lacks {missing} (another vLLM release?)"
    if builder.use_dcp:
        return "decode context parallelism (its decode seq_lens are rank-local)"
    if not builder.use_trtllm_decode_attention:
        return "its decodes run flashinfer's native wrapper (FIDecode: no block_tables, seq_lens, query starts)"
    forced = int(builder.page_size) >= 128 or builder.attention_config.use_trtllm_attention is True
    if not (forced and _trtllm_prefill_supported()):
        return (
            "its prefills may run flashinfer's native wrapper (FIPrefill: no block_tables, seq_lens, query "
            "starts); set attention_config.use_trtllm_attention=1 on a GPU with TRTLLM prefill (SM100)"
        )
    return None


def _trtllm_prefill_supported() -> bool:
    from vllm.utils.flashinfer import supports_trtllm_attention

    return bool(supports_trtllm_attention(is_prefill=True))
