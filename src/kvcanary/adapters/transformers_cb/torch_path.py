"""The per-step translation of a group by torch ops (:mod:`.translate`'s read-index path without the kernel, and
the decode fast path from flash attention's block table), with the plan of each group's work."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from kvcanary.adapters.transformers_cb import step_plan, translate_kernel
from kvcanary.adapters.transformers_cb.batch_shapes import flat
from kvcanary.adapters.transformers_cb.geometry import GroupGeometry
from kvcanary.adapters.transformers_cb.staging import Pack
from kvcanary.adapters.transformers_cb.step_buffers import pad_writes
from kvcanary.schema import NOT_STORED

_REJECTED_SEGMENT = -(1 << 30)  # start of a mis-delimited segment: every offset from it is out of range


@dataclasses.dataclass(frozen=True)
class GroupWork:
    """One group's host plan and where its arrays sit in the pack."""

    geometry: GroupGeometry
    path: str  # "kernel" (one launch), "torch" (the read-index ops) or "block_table" (decode fast path)
    entries: step_plan.GroupEntries | None  # every cell on the host: the torch and block-table paths
    n_write: int  # write entries translated (min(write index length, tokens))
    arrays: dict[str, int]

    @property
    def windowed(self) -> bool:
        """A sliding group on the one-launch path: its trash mask is staged at the step's token count."""
        return self.path == "kernel" and self.geometry.is_sliding


def plan_group(
    g: GroupGeometry, rows: step_plan.RowPlan, kwargs: Mapping[str, Any], pack: Pack, sizes: tuple[int, int, int],
    *, one_launch: bool, width: int,
) -> GroupWork:  # fmt: skip
    """A group's work this step, its host arrays added to ``pack``.  ``sizes``: the write entries translated, the
    read index's length and the scheduler's query tokens; ``one_launch``: the read-index path may be one Triton launch
    (:mod:`.translate_kernel`; a window's trash mask is then packed by the translator at the class's token count);
    ``width``: the table's."""
    n_write, n_read, num_tokens = sizes
    if one_launch and translate_kernel.covers(g, rows, kwargs, n_read):
        return GroupWork(g, "kernel", None, n_write, {})
    entries = step_plan.group_entries(g, rows, width)
    arrays = {}
    if entries.count:
        arrays["cells"] = pack.add(entries.cells)
    if entries.edges.shape[0]:
        arrays["edges"] = pack.add(entries.edges)
    block_table = kwargs.get("block_table")
    if block_table is not None:
        bt = block_table[g.index]
        lookups = step_plan.block_lookups(g, rows, entries, (int(bt.shape[0]), int(bt.shape[1])))
        arrays.update(
            bt_row=pack.add(lookups.bt_row),
            bt_col=pack.add(lookups.bt_col),
            page_offset=pack.add(lookups.page_offset),
            in_table=pack.add(lookups.in_table),
        )
        return GroupWork(g, "block_table", entries, num_tokens, arrays)
    if entries.count:
        arrays.update(
            row=pack.add(entries.row), offset=pack.add(entries.offset), expected=pack.add(entries.expected_seg)
        )
        if n_read == 0 and bool(entries.new.any()):
            # No row reads the cache (a batch of first chunks): attention takes the new tokens' K/V
            # directly, so their cells hold the sentinel (reserved: nothing read from the pool to check).
            arrays["new_cells"] = pack.add(entries.cells[entries.new])
    trash = step_plan.trash_writes(g, rows, n_write)
    if trash is not None:
        arrays["trash"] = pack.add(trash)
    return GroupWork(g, "torch", entries, n_write, arrays)


def from_read_index(
    w: GroupWork, kwargs: Mapping[str, Any], b: int, dev: list[torch.Tensor], n_tok: int, cells: torch.Tensor
) -> torch.Tensor:
    """Fill the table from the read index; return out_cache_loc from the write index."""
    g, a = w.geometry, w.arrays
    write = flat(kwargs["write_index"][g.index])[: w.n_write]
    gathered = None
    if host_entries(w).count:
        read = flat(kwargs["read_index"][g.index])
        cu_k = flat(kwargs["cu_seq_lens_k"][g.name])
        n_read = int(read.shape[0])
        if int(cu_k.shape[0]) < b + 1 or n_read == 0:
            cells.index_fill_(0, dev[a["cells"]], g.invalid_slot)
            if "new_cells" in a:
                cells.index_fill_(0, dev[a["new_cells"]], g.sentinel_slot)
        else:
            cu = cu_k[: b + 1]
            seg_ok = (cu[1:] - cu[:-1]) == dev[a["expected"]]
            seg_start = torch.where(seg_ok, cu[:-1], _REJECTED_SEGMENT)
            # index_select / index_copy_: the plain-tensor forms of these gathers, without the Python
            # indexing machinery (each costs host time per step on a GPU).
            src = torch.index_select(seg_start, 0, dev[a["row"]]) + dev[a["offset"]]
            src_in = src.clamp(0, n_read - 1)
            gathered = torch.where(src_in == src, torch.index_select(read, 0, src_in), -1)  # -1: the invalid slot
    # Writes first: out_cache_loc is then the start of the mapped tensor (aligned for the kernels).
    slots = g.to_slots(write if gathered is None else torch.cat([write, gathered]))
    if gathered is not None:
        cells.index_copy_(0, dev[a["cells"]], slots[w.n_write :].to(torch.int32))
    if "edges" in a:
        cells.index_fill_(0, dev[a["edges"]], g.read_trash_slot)
    out = slots[: w.n_write]
    if "trash" in a:
        by_design = dev[a["trash"]] & (write == g.write_trash_index)
        out = torch.where(by_design, NOT_STORED, out)
    return pad_writes(out, n_tok)


def from_block_table(
    w: GroupWork, block_table: torch.Tensor, dev: list[torch.Tensor], n_tok: int, cells: torch.Tensor
) -> torch.Tensor:
    """Decode fast path: entries are ``block * (stride // page)``; slot of pos = entry * page + pos % page."""
    g, a = w.geometry, w.arrays
    ok = dev[a["in_table"]]
    if block_table.numel():
        entry = block_table[dev[a["bt_row"]], dev[a["bt_col"]]].long()
        phys = torch.where(ok & (entry >= 0), torch.add(dev[a["page_offset"]], entry, alpha=g.page_size), -1)
    else:
        phys = torch.full(ok.shape, -1, dtype=torch.int64, device=cells.device)
    slots = g.to_slots(phys)
    if host_entries(w).count:
        cells.index_copy_(0, dev[a["cells"]], slots[w.n_write :].to(torch.int32))
    if "edges" in a:
        cells.index_fill_(0, dev[a["edges"]], g.read_trash_slot)
    return pad_writes(slots[: w.n_write], n_tok)


def host_entries(w: GroupWork) -> step_plan.GroupEntries:
    if w.entries is None:
        raise AssertionError(f"group {w.geometry.name!r}: the {w.path} path has no host entries")
    return w.entries
