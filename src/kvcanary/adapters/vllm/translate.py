"""What one vLLM forward receives, as :class:`~kvcanary.StepBatch` es (one per KV cache group).

Per batch row ``r`` of the step (``input_batch`` order, which is also the attention metadata's row order):

==================  ===========================================================================
StepBatch           vLLM (V1 runner, attention metadata of the group's first layer)
==================  ===========================================================================
``table``           the metadata's block table (kernel blocks; ``page_size`` = the kernel block size)
``rows``            ``r`` (the metadata's block table holds the step's rows only)
``extend_lens``     the row's query length (scheduled tokens, drafts included)
``prefix_lens``     its sequence length minus ``extend_lens[r]`` (``num_computed_tokens``)
``input_ids``       the ``input_ids`` the model forward is called with
``positions``       the ``positions`` the model forward is called with
``out_cache_loc``   the forward context's ``slot_mapping`` of the group (what the KV write uses)
``truth``           the requests' own prompt + output token ids (:mod:`.truth`)
==================  ===========================================================================

Where each backend keeps the table, lengths and query starts is :mod:`.metadata`'s business: ``CPU_ATTN``,
``FLASH_ATTN``, ``TRITON_ATTN`` and ``FLEX_ATTENTION`` keep ``block_table``, ``seq_lens`` and
``query_start_loc``; ``FLASHINFER`` keeps them per decode and prefill part (its TRTLLM paths only).

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

from kvcanary.adapters.vllm.metadata import int_tensor, read_rows
from kvcanary.batch import StepBatch


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


def group_view(metadata: Any, slot_mapping: torch.Tensor | None, num_reqs: int, num_tokens: int) -> GroupView:
    """The group's :class:`GroupView` from its attention metadata (and the forward context's slot mapping)."""
    rows = read_rows(metadata, num_reqs)
    slots = (rows.slot_mapping if slot_mapping is None else int_tensor(slot_mapping, "slot_mapping"))[:num_tokens]
    return GroupView(rows.table.contiguous(), rows.seq_lens - rows.extend_lens, rows.extend_lens, slots.contiguous())


def _tokens(value: object, n: int, what: str) -> torch.Tensor:
    t = int_tensor(value, what)
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
