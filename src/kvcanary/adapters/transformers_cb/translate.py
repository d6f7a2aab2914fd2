"""Per step: the forward kwargs attention received + the host's view of the batch -> one StepBatch per group.

The table is adapter-owned: row ``r + 1`` belongs to batch row ``r`` for this step only (row 0 is the
padding row) and is filled, over the span the canary verifies, from the request's segment of
``read_index[g]`` as delimited by ``cu_seq_lens_k`` -- exactly what the attention layers gather.  A
wrong read index therefore shows up as a wrong slot.  A segment whose length differs from what the
scheduler expects (``past + query`` for full attention, ``min(past, W - 1) + query`` for a window of W)
fills the span with an out-of-range slot, so a mis-delimited batch is reported instead of trusted.

Sliding groups: the canary window is ``W - 1`` (the past tokens attention reads); the entry just before
the window is set to the read-trash slot, a reserved slot, so the first read token's link is not checked
against a predecessor attention never reads (its position and token still are).  Writes of a query
longer than the window go to the write trash by design; those map to ``NOT_STORED``.

The decode fast path (flash ``block_table``, GPU only) is translated from the block table instead.

Not verified: the read entries of the step's own tokens (a full group reads them back right after
writing them; a sliding group marks them with sentinel entries).  The canonical batch verifies the
prefix only, so a read index that sends one of them elsewhere for a single step goes unnoticed; from
the next step on, those tokens are prefix and their read entries are verified.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvcanary.adapters.transformers_cb.geometry import GroupGeometry
from kvcanary.adapters.transformers_cb.host_batch import HostBatch
from kvcanary.batch import StepBatch
from kvcanary.schema import NOT_STORED, UNKNOWN_TOKEN


@dataclasses.dataclass(frozen=True)
class Translation:
    batches: dict[str, StepBatch]  # by group name
    request_ids: tuple[str, ...]  # per batch row
    rows_too_long: int  # rows left out: longer than the table (counted, never verified)
    ring_wraps: int  # sliding-group writes that overwrote an older token of the ring
    padded: bool  # the engine padded the batch (compile / CUDA graphs)
    block_table: bool  # decode fast path


@dataclasses.dataclass(frozen=True)
class _Spans:
    """Host-side per-row plan of one group: which positions to fill from where."""

    starts: list[int]  # first verified position per row
    counts: list[int]  # verified positions per row (0 for rows left out)
    expected_seg: list[int]  # read-segment length the scheduler expects


class StepTranslator:
    """Static tables for one bound cache; :meth:`translate` fills them for each step."""

    def __init__(
        self,
        geometries: Sequence[GroupGeometry],
        *,
        max_batch: int,
        max_context: int,
        device: torch.device | str,
    ) -> None:
        if max_batch <= 0 or max_context <= 0:
            raise ValueError(f"max_batch and max_context must be positive, got {max_batch} and {max_context}")
        self.geometries = tuple(geometries)
        self.max_batch = max_batch
        self.width = max_context
        self.device = torch.device(device)
        shape = (max_batch + 1, max_context)
        self.tables = {g.name: torch.zeros(shape, dtype=torch.int32, device=self.device) for g in self.geometries}
        self.truth = torch.full(shape, UNKNOWN_TOKEN, dtype=torch.int32, device=self.device)

    # ------------------------------------------------------------------ entry point

    def translate(self, kwargs: Mapping[str, Any], host: HostBatch) -> Translation:
        b = host.batch_size
        if b > self.max_batch:
            raise ValueError(f"batch has {b} requests, more than max_batch={self.max_batch}")
        input_ids = kwargs["input_ids"].reshape(-1)
        positions = kwargs["position_ids"].reshape(-1)
        n_tok = int(input_ids.shape[0])
        if host.num_tokens > n_tok:
            raise RuntimeError(
                f"the scheduler planned {host.num_tokens} query tokens but the forward received {n_tok}: "
                "the host batch and the forward kwargs are out of step"
            )
        live = [p + q <= self.width for p, q in zip(host.past_lens, host.query_lens, strict=True)]
        dev = self.device
        rows = torch.tensor([r + 1 if ok else 0 for r, ok in enumerate(live)], dtype=torch.int64, device=dev)
        prefix = torch.tensor(host.past_lens, dtype=torch.int64, device=dev)
        extend = torch.tensor(host.query_lens, dtype=torch.int64, device=dev)
        truth_lens = self._fill_truth(host, live)
        block_table = kwargs.get("block_table")
        cu_q = kwargs.get("cu_seq_lens_q")
        padded = n_tok > host.num_tokens or (cu_q is not None and int(cu_q.shape[0]) > b + 1)

        batches: dict[str, StepBatch] = {}
        wraps = 0
        for g in self.geometries:
            spans = self._spans(g, host, live)
            if block_table is not None:
                out_loc = self._fill_from_block_table(g, block_table[g.index], host, spans, n_tok)
            else:
                self._fill_from_read_index(g, kwargs, b, spans)
                out_loc = self._out_cache_loc(g, kwargs["write_index"][g.index], host, n_tok)
            if g.is_sliding:
                wraps += _ring_wraps(g.sliding_window, host, live)
            batches[g.name] = StepBatch(
                rows=rows,
                prefix_lens=prefix,
                extend_lens=extend,
                table=self.tables[g.name],
                input_ids=input_ids,
                positions=positions,
                out_cache_loc=out_loc,
                truth=self.truth,
                truth_lens=truth_lens,
            )
        return Translation(
            batches=batches,
            request_ids=host.request_ids,
            rows_too_long=live.count(False),
            ring_wraps=wraps,
            padded=padded,
            block_table=block_table is not None,
        )

    # ------------------------------------------------------------------ ground truth

    def _fill_truth(self, host: HostBatch, live: list[bool]) -> torch.Tensor:
        lens = [min(len(t), self.width) if ok else 0 for t, ok in zip(host.truth, live, strict=True)]
        total = sum(lens)
        if total:
            flat = torch.tensor(
                list(itertools.chain.from_iterable(t[:n] for t, n in zip(host.truth, lens, strict=True))),
                dtype=torch.int32,
            )
            n = torch.tensor(lens, dtype=torch.int64)
            row = torch.repeat_interleave(torch.arange(len(lens)), n)
            col = torch.arange(total) - torch.repeat_interleave(torch.cumsum(n, 0) - n, n)
            self.truth[(row + 1).to(self.device), col.to(self.device)] = flat.to(self.device)
        return torch.tensor(lens, dtype=torch.int64, device=self.device)

    # ------------------------------------------------------------------ tables

    def _spans(self, g: GroupGeometry, host: HostBatch, live: list[bool]) -> _Spans:
        starts, counts, expected = [], [], []
        for past, query, ok in zip(host.past_lens, host.query_lens, live, strict=True):
            start = max(0, past - g.canary_window) if g.is_sliding else 0
            starts.append(start)
            counts.append(past - start if ok else 0)
            expected.append(past - start + query)
        return _Spans(starts, counts, expected)

    def _entries(self, spans: _Spans) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(batch row, offset in the read segment, table column) of every verified position."""
        counts = torch.tensor(spans.counts, dtype=torch.int64)
        row = torch.repeat_interleave(torch.arange(len(spans.counts)), counts)
        j = torch.arange(int(counts.sum())) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        col = torch.tensor(spans.starts, dtype=torch.int64)[row] + j
        return row.to(self.device), j.to(self.device), col.to(self.device)

    def _mark_window_edges(self, g: GroupGeometry, table: torch.Tensor, spans: _Spans) -> None:
        if not g.is_sliding:
            return
        edge = [(r, s - 1) for r, (s, c) in enumerate(zip(spans.starts, spans.counts, strict=True)) if s > 0 and c]
        if edge:
            idx = torch.tensor(edge, dtype=torch.int64, device=self.device)
            table[idx[:, 0] + 1, idx[:, 1]] = g.read_trash_slot

    def _fill_from_read_index(self, g: GroupGeometry, kwargs: Mapping[str, Any], b: int, spans: _Spans) -> None:
        table = self.tables[g.name]
        row, j, col = self._entries(spans)
        if row.numel():
            read = kwargs["read_index"][g.index].reshape(-1)
            cu_k = kwargs["cu_seq_lens_k"][g.name].reshape(-1).long()
            if cu_k.shape[0] < b + 1:
                slots = torch.full_like(row, g.invalid_slot)
            else:
                seg_start = cu_k[:b]
                seg_ok = (cu_k[1 : b + 1] - seg_start) == torch.tensor(spans.expected_seg, device=self.device)
                src = seg_start[row] + j
                n_read = int(read.shape[0])
                ok = seg_ok[row] & (src >= 0) & (src < n_read)
                gathered = read[src.clamp(0, max(n_read - 1, 0))] if n_read else torch.zeros_like(src)
                slots = torch.where(ok, g.to_slots(gathered), g.invalid_slot)
            table[row + 1, col] = slots.to(torch.int32)
        self._mark_window_edges(g, table, spans)

    def _out_cache_loc(self, g: GroupGeometry, write: torch.Tensor, host: HostBatch, n_tok: int) -> torch.Tensor:
        write = write.reshape(-1)
        m = min(int(write.shape[0]), n_tok)
        out = torch.full((n_tok,), NOT_STORED, dtype=torch.int64, device=self.device)
        slots = g.to_slots(write[:m])
        if g.is_sliding:
            # The first query - W tokens of a long query are computed but not kept: trash writes by design.
            trash = torch.zeros(n_tok, dtype=torch.bool)
            t = 0
            for q in host.query_lens:
                trash[t : t + max(0, q - g.sliding_window)] = True
                t += q
            by_design = trash[:m].to(self.device) & (write[:m] == g.write_trash_index)
            slots = torch.where(by_design, NOT_STORED, slots)
        out[:m] = slots
        return out

    def _fill_from_block_table(
        self, g: GroupGeometry, block_table: torch.Tensor, host: HostBatch, spans: _Spans, n_tok: int
    ) -> torch.Tensor:
        """Decode fast path: entries are ``block * (stride // page)``; slot of pos = entry * page + pos % page."""
        table = self.tables[g.name]
        bt = block_table.long()
        n_cols = int(bt.shape[1])
        page = g.page_size

        def phys(rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            page_idx = torch.div(pos, page, rounding_mode="floor")
            ok = (rows < bt.shape[0]) & (page_idx < n_cols) & (pos >= 0)
            entry = bt[rows.clamp(0, bt.shape[0] - 1), page_idx.clamp(0, n_cols - 1)]
            return torch.where(ok & (entry >= 0), entry * page + pos % page, -1)

        row, _, col = self._entries(spans)
        if row.numel():
            table[row + 1, col] = g.to_slots(phys(row, col)).to(torch.int32)
        self._mark_window_edges(g, table, spans)
        q = torch.tensor(host.query_lens, dtype=torch.int64)
        trow = torch.repeat_interleave(torch.arange(host.batch_size), q)
        tpos = torch.tensor(host.past_lens, dtype=torch.int64)[trow] + (
            torch.arange(int(q.sum())) - torch.repeat_interleave(torch.cumsum(q, 0) - q, q)
        )
        out = torch.full((n_tok,), NOT_STORED, dtype=torch.int64, device=self.device)
        if trow.numel():
            out[: trow.numel()] = g.to_slots(phys(trow.to(self.device), tpos.to(self.device)))
        return out


def _ring_wraps(window: int, host: HostBatch, live: list[bool]) -> int:
    """Stored writes at positions >= W: each overwrote the ring slot of position - W."""
    n = 0
    for past, q, ok in zip(host.past_lens, host.query_lens, live, strict=True):
        if ok:
            end = past + q
            n += max(0, end - max(window, end - min(q, window)))
    return n
