"""vLLM's KV cache groups as canary groups, and the capacities the engine's limits imply.

Each ``kv_cache_config.kv_cache_groups[g]`` is one index space: slot = block * block_size + offset, over
``kv_cache_config.num_blocks`` scheduler blocks of ``kv_cache_spec.block_size`` tokens; the block table the
attention reads holds *kernel* blocks (``input_batch.block_table[g].block_size``, a divisor of it), which is
the canary's page size.  Block 0 is vLLM's null block (never given to a request; sliding-window tables point
out-of-window positions at it): its first slot is reserved.  Full attention (also MLA) maps onto a FULL group,
a sliding window onto a SLIDING_WINDOW group; any other spec (Mamba state, chunked local attention, encoder
caches) is a layout the canary does not know, refused at install, and so is an attention backend whose
metadata :mod:`.metadata` cannot read every step (FlashInfer's native paths).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvcanary.adapters.vllm.metadata import flashinfer_refusal
from kvcanary.layout import CanaryGroup, GroupKind
from kvcanary.workspace import Capacities

FULL_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")
WINDOW_SPECS = ("SlidingWindowSpec",)
KNOWN_BACKENDS = ("CPU_ATTN", "FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION")
VERIFY_SLOTS_FACTOR = 4


@dataclasses.dataclass(frozen=True)
class VllmGroup:
    """A canary group and where its step data lives in vLLM."""

    canary: CanaryGroup
    index: int  # kv_cache_groups index
    layer: str  # the group's first layer: whose attention metadata and slot mapping the canary reads
    block_size: int  # scheduler block size: the unit of block copies and zeroing
    zeroed_on_reuse: bool  # vLLM zeroes this group's new blocks (full attention only)


def _spec_kind(spec: Any, g: int) -> tuple[GroupKind, int]:
    name = type(spec).__name__
    if name in FULL_SPECS:
        return GroupKind.FULL, 0
    if name in WINDOW_SPECS:
        # A token at p attends to [p - W + 1, p]: of its prefix, vLLM keeps (and reads) the last W - 1 positions.
        return GroupKind.SLIDING_WINDOW, max(int(spec.sliding_window) - 1, 1)
    raise ValueError(
        f"kvcanary: KV cache group {g} uses {name}, a KV layout the vLLM adapter does not know "
        f"(supported: {', '.join(FULL_SPECS + WINDOW_SPECS)}); unset KVCANARY_MODE to serve this model"
    )


def _backend_refusal(runner: Any, g: int) -> str | None:
    """Why group ``g``'s attention metadata cannot be read (None: every backend of the group is readable)."""
    groups = getattr(runner, "attn_groups", None) or []
    for attn_group in groups[g] if g < len(groups) else []:
        name = str(attn_group.backend.get_name())
        if name not in KNOWN_BACKENDS:
            return (
                f"uses attention backend {name}, whose metadata the vLLM adapter does not know "
                f"(supported: {', '.join(KNOWN_BACKENDS)})"
            )
        for builder in getattr(attn_group, "metadata_builders", None) or []:
            why = flashinfer_refusal(builder) if name == "FLASHINFER" else None
            if why is not None:
                return f"uses attention backend FLASHINFER, whose metadata the canary cannot read every step: {why}"
    return None


def vllm_groups(runner: Any) -> list[VllmGroup]:
    """One :class:`VllmGroup` per KV cache group of ``runner`` (after ``initialize_kv_cache``)."""
    config = getattr(runner, "kv_cache_config", None)
    if config is None or not getattr(config, "kv_cache_groups", None):
        raise ValueError("kvcanary: the model runner has no KV cache yet (install after initialize_kv_cache)")
    tables = runner.input_batch.block_table.block_tables
    out = []
    for g, group in enumerate(config.kv_cache_groups):
        kind, window = _spec_kind(group.kv_cache_spec, g)
        refusal = _backend_refusal(runner, g)
        if refusal is not None:
            raise ValueError(f"kvcanary: KV cache group {g} {refusal}")
        block_size = int(group.kv_cache_spec.block_size)
        page = int(tables[g].block_size)
        name = "full" if g == 0 and kind is GroupKind.FULL else f"group{g}"
        canary = CanaryGroup(
            num_slots=int(config.num_blocks) * block_size,
            group_id=g,
            name=name,
            kind=kind,
            window=window,
            page_size=page,
            reserved_slots=(0,),
            padding_row=None,
        )
        out.append(VllmGroup(canary, g, group.layer_names[0], block_size, kind is GroupKind.FULL))
    return out


def capacities(runner: Any, group: CanaryGroup, log_rows: int) -> Capacities:
    """Per-step bounds from the scheduler's limits (never from one batch)."""
    max_batch = int(runner.input_batch.max_num_reqs)
    max_tokens = int(runner.scheduler_config.max_num_batched_tokens)
    max_context = int(runner.max_model_len)
    span = min(group.window, max_context) if group.window > 0 else max_context
    verify = max(span, min(VERIFY_SLOTS_FACTOR * group.num_slots, max_batch * span))
    return Capacities(
        max_batch=max_batch, max_tokens=max_tokens, verify_entries=verify, max_context=max_context, log_rows=log_rows
    )
