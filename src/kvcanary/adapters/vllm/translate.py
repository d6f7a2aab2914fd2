"""What one vLLM forward receives, as :class:`~kvcanary.StepBatch` es (one per KV cache group).

Per batch row ``r`` of the step (``input_batch`` order, which is also the attention metadata's row order):

==================  ===========================================================================
StepBatch           vLLM (V1 runner, attention metadata of the group's first layer)
==================  ===========================================================================
``table``           ``metadata.block_table`` (kernel blocks; ``page_size`` = the kernel block size)
``rows``            ``r`` (the metadata's block table holds the step's rows only)
``extend_lens``     ``query_start_loc[r + 1] - query_start_loc[r]`` (scheduled tokens, drafts included)
``prefix_lens``     ``seq_lens[r] - extend_lens[r]`` (``num_computed_tokens``)
``input_ids``       the ``input_ids`` the model forward is called with
``positions``       the ``positions`` the model forward is called with
``out_cache_loc``   the forward context's ``slot_mapping`` of the group (what the KV write uses)
``truth``           the requests' own prompt + output token ids (:mod:`.truth`)
==================  ===========================================================================

The fields are read by attribute name, so the same code maps the CPU backend's ``CPUAttentionMetadata`` and
the GPU backends' ``FlashAttentionMetadata`` / ``TritonAttentionMetadata`` (same four fields).

Same-step prefix hits: vLLM caches a block when the request that fills it is scheduled, so a request admitted
later in the same step can hit it and attention reads it right after that step's KV write.  The canary verifies
before it stamps, so such a reader is verified in a later *pass* of the same step, after its writers' stamps
(:func:`passes`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvcanary.batch import StepBatch

METADATA_FIELDS = ("query_start_loc", "seq_lens", "block_table", "slot_mapping")


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """The step's per-row and per-token tensors, shared by every group."""

    num_reqs: int
    num_tokens: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    truth: torch.Tensor | None
    truth_lens: torch.Tensor | None


@dataclasses.dataclass(frozen=True)
class GroupView:
    """One group's part of the step: its block table, lengths and written slots."""

    table: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    out_cache_loc: torch.Tensor


def _int_tensor(value: object, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"vLLM {what} must be an int32/int64 tensor, got {value!r:.80}")
    return value


def group_view(metadata: Any, slot_mapping: torch.Tensor | None, num_reqs: int, num_tokens: int) -> GroupView:
    """The group's :class:`GroupView` from its attention metadata (and the forward context's slot mapping)."""
    missing = [f for f in METADATA_FIELDS if not hasattr(metadata, f)]
    if missing:
        raise TypeError(
            f"attention metadata {type(metadata).__name__} lacks {missing}: a layout the canary does not know"
        )
    qsl = _int_tensor(metadata.query_start_loc, "query_start_loc")[: num_reqs + 1]
    seq = _int_tensor(metadata.seq_lens, "seq_lens")[:num_reqs]
    table = _int_tensor(metadata.block_table, "block_table")[:num_reqs]
    slots = _int_tensor(metadata.slot_mapping if slot_mapping is None else slot_mapping, "slot_mapping")[:num_tokens]
    extend = qsl[1:] - qsl[:-1]
    prefix = seq - extend
    return GroupView(table.contiguous(), prefix, extend, slots.contiguous())


def _tokens(value: object, n: int, what: str) -> torch.Tensor:
    t = _int_tensor(value, what)
    if t.dim() != 1:
        raise ValueError(f"vLLM {what} has shape {tuple(t.shape)}; the canary needs 1-D (no M-RoPE)")
    return t[:n].contiguous()


def step_inputs(
    input_ids: object,
    positions: object,
    num_reqs: int,
    num_tokens: int,
    truth: tuple[torch.Tensor, torch.Tensor] | None,
) -> StepInputs:
    ids = _tokens(input_ids, num_tokens, "input_ids")
    pos = _tokens(positions, num_tokens, "positions")
    t, lens = (None, None) if truth is None else (truth[0], truth[1][:num_reqs])
    return StepInputs(num_reqs, num_tokens, ids, pos, t, lens)


def batch_for(view: GroupView, inputs: StepInputs, rows: Sequence[int] | None = None) -> StepBatch:
    """The group's StepBatch for all rows (``rows`` None) or for a subset of them (one pass)."""
    if rows is None:
        idx = torch.arange(inputs.num_reqs, dtype=torch.int64, device=view.table.device)
        return StepBatch(
            idx, view.prefix_lens, view.extend_lens, view.table, inputs.input_ids, inputs.positions,
            view.out_cache_loc, inputs.truth, inputs.truth_lens,
        )  # fmt: skip
    idx = torch.tensor(list(rows), dtype=torch.int64, device=view.table.device)
    starts = torch.cumsum(view.extend_lens, 0) - view.extend_lens
    tok = _token_index(starts[idx], view.extend_lens[idx])
    lens = None if inputs.truth_lens is None else inputs.truth_lens[idx].contiguous()
    return StepBatch(
        idx, view.prefix_lens[idx].contiguous(), view.extend_lens[idx].contiguous(), view.table,
        inputs.input_ids[tok], inputs.positions[tok], view.out_cache_loc[tok], inputs.truth, lens,
    )  # fmt: skip


def _token_index(starts: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    parts = [torch.arange(int(s), int(s) + int(n), dtype=torch.int64) for s, n in zip(starts, lens, strict=True)]
    return torch.cat(parts).to(starts.device) if parts else torch.zeros(0, dtype=torch.int64, device=starts.device)


def passes(views: Sequence[GroupView], candidates: Sequence[int], page_sizes: Sequence[int]) -> list[list[int]] | None:
    """Rows grouped into passes so that each row is verified after the stamps of the rows whose writes it reads.

    ``candidates``: rows that may read another row's writes of this step (requests admitted this step with
    cached tokens).  None when no candidate reads any (the common case: one pass, no host reads of the rest).
    """
    if not candidates:
        return None
    num_rows = int(views[0].prefix_lens.shape[0])
    deps: dict[int, set[int]] = {}
    for view, page in zip(views, page_sizes, strict=True):
        _add_dependencies(deps, view, candidates, page)
    if not deps:
        return None
    level = dict.fromkeys(range(num_rows), 0)
    for _ in range(num_rows):  # longest dependency chain; a cycle (a real engine never makes one) stops here
        changed = False
        for r, ws in deps.items():
            want = 1 + max(level[w] for w in ws)
            if want > level[r]:
                level[r], changed = want, True
        if not changed:
            break
    out: list[list[int]] = [[] for _ in range(max(level.values()) + 1)]
    for r in range(num_rows):
        out[level[r]].append(r)
    return [p for p in out if p]


def _add_dependencies(deps: dict[int, set[int]], view: GroupView, candidates: Sequence[int], page: int) -> None:
    extend = view.extend_lens.cpu().numpy().astype(np.int64)
    prefix = view.prefix_lens.cpu().numpy().astype(np.int64)
    slots = view.out_cache_loc.cpu().numpy()
    writer = np.repeat(np.arange(extend.shape[0]), extend)[: slots.shape[0]]
    written: dict[int, int] = {}
    for block, row in zip((slots[slots >= 0] // page).tolist(), writer[slots >= 0].tolist(), strict=True):
        written.setdefault(int(block), int(row))
    if not written:
        return
    table = view.table.cpu().numpy()
    for r in candidates:
        n_blocks = -(-int(prefix[r]) // page)
        for block in table[r, :n_blocks].tolist():
            w = written.get(int(block))
            if w is not None and w != r:
                deps.setdefault(r, set()).add(w)
