"""Per-step buffers of the transformers translation: the host arrays of one staging copy (and the order of the
shared ones), and the ``out_cache_loc`` buffers whose addresses stay put (what the canary's step graphs key on)."""

from __future__ import annotations

import array
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvcanary.adapters.transformers_cb.batch_shapes import RecurringViews, pad_rows
from kvcanary.adapters.transformers_cb.geometry import GroupGeometry
from kvcanary.adapters.transformers_cb.staging import Pack
from kvcanary.adapters.transformers_cb.step_plan import RowPlan
from kvcanary.adapters.transformers_cb.truth_store import TruthUpdate
from kvcanary.schema import NOT_STORED


def pack_common(pack: Pack, rows: RowPlan, truth: TruthUpdate, sizes: array.array[int], n_rows: int) -> dict[str, int]:
    """The arrays every group shares, by name (the truth's writes are packed after the groups' arrays), the
    per-row ones padded to ``n_rows`` rows (padding rows: table row 0, no lengths).  The per-row arrays and the
    sizes first: their device views then sit at offsets that depend on the batch size only, so a step's batch
    tensors and the translation's launch keep their addresses from step to step (what the step graphs key on)."""
    return {
        "rows": pack.add(pad_rows(rows.table_rows(), n_rows)),
        "prefix": pack.add(pad_rows(rows.past_lens, n_rows)),
        "extend": pack.add(pad_rows(rows.query_lens, n_rows)),
        "truth_lens": pack.add(truth.lens),
        "truth_gather": pack.add(truth.gather),
        "sizes": pack.add(sizes),
    }


def index_sizes(kwargs: Mapping[str, Any], geometries: Sequence[GroupGeometry], n_tok: int) -> array.array[int]:
    """Per group, three entries: the write entries translated, the read index's length and the forward's token
    count (the translation kernel reads them on the device, so its launch does not change with them); on the
    block-table path only the token count."""
    if kwargs.get("block_table") is not None:
        return array.array("q", [0, 0, n_tok] * len(geometries))
    write, read = kwargs["write_index"], kwargs["read_index"]
    sizes: list[int] = []
    for g in geometries:
        sizes += (group_writes(write[g.index].numel(), n_tok), read[g.index].numel(), n_tok)
    return array.array("q", sizes)


def group_writes(n_write: int, n_tok: int) -> int:
    """A group's write entries translated: its write index's length, at most the forward's token count."""
    return n_write if n_write < n_tok else n_tok


def pad_writes(out: torch.Tensor, n_tok: int) -> torch.Tensor:
    """out_cache_loc for every token of the forward: tokens past the translated writes are not stored."""
    if int(out.shape[0]) == n_tok:
        return out
    full = torch.full((n_tok,), NOT_STORED, dtype=torch.int64, device=out.device)
    full[: out.shape[0]] = out
    return full


class StableWrites:
    """Each group's ``out_cache_loc`` copied into a buffer of its own (one copy a step), so that its address
    depends on nothing but the group: what the step graphs key on."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: dict[str, torch.Tensor] = {}
        self._views: RecurringViews[torch.Tensor] = RecurringViews()

    def view(self, name: str, n: int) -> torch.Tensor:
        """The group's buffer as ``n`` int64 writes (grown to the next power of two when short)."""
        buf = self._buffers.get(name)
        if buf is None or buf.shape[0] < n:
            size = max(64, 1 << max(n - 1, 0).bit_length())
            buf = self._buffers[name] = torch.empty(size, dtype=torch.int64, device=self.device)
            self._views.clear()
        return self._views.get((name, n), lambda: buf[:n])

    def writes(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """``out`` copied into the group's buffer (when it is not there already)."""
        view = self.view(name, int(out.shape[0]))
        if out.data_ptr() != view.data_ptr():
            view.copy_(out)
        return view
