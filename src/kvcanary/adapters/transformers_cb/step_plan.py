"""The host half of a step's translation: everything that follows from the scheduler's lengths (numpy).

The scheduler knows each row's past and query lengths on the host, so which table cells a step fills,
which read-segment offset each comes from, and which tokens are written to the trash by design are
computed here with a few vectorised numpy calls, then sent to the device in one copy
(:mod:`.staging`).  Only what the engine handed to attention -- the index tensors -- is read on the
device.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import typing
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvcanary.adapters.transformers_cb.geometry import GroupGeometry
from kvcanary.adapters.transformers_cb.host_batch import HostBatch

I64 = npt.NDArray[np.int64]
MAX_ENTRIES = 1 << 30  # per group and step; keeps a rejected segment's offsets (-2^30 + offset) negative


class RowPlan:
    """Per batch row: past and query lengths, and whether the row fits the table (``live``).

    Kept as the host's tuples; the numpy forms are made on first use, by the paths that compute per-cell arrays.
    The one-launch path needs only per-row values, built in plain Python (see
    :func:`~kvcanary.adapters.transformers_cb.batch_shapes.pad_rows`).  A plain class, not a frozen dataclass: it is
    built every step, cold (see :mod:`.staging`), and a frozen dataclass's initialiser is several times dearer."""

    def __init__(self, past_lens: tuple[int, ...], query_lens: tuple[int, ...], live_rows: tuple[bool, ...]) -> None:
        self.past_lens, self.query_lens, self.live_rows = past_lens, query_lens, live_rows

    @classmethod
    def of(cls, host: HostBatch, width: int) -> RowPlan:
        past, query = host.past_lens, host.query_lens
        return cls(past, query, tuple([p + q <= width for p, q in zip(past, query, strict=True)]))

    @functools.cached_property
    def past(self) -> I64:
        return np.array(self.past_lens, dtype=np.int64)

    @functools.cached_property
    def query(self) -> I64:
        return np.array(self.query_lens, dtype=np.int64)

    @functools.cached_property
    def live(self) -> npt.NDArray[np.bool_]:
        return np.array(self.live_rows, dtype=np.bool_)

    @functools.cached_property
    def reads_or_writes(self) -> bool:
        """Whether any row in the table has a token: only then does any group fill a table cell."""
        return any(ok and p + q > 0 for p, q, ok in zip(self.past_lens, self.query_lens, self.live_rows, strict=True))

    @property
    def size(self) -> int:
        return len(self.past_lens)

    @property
    def rows_too_long(self) -> int:
        return self.live_rows.count(False)

    def table_rows(self) -> list[int]:
        """Row ``r + 1`` of the table for batch row r; the padding row 0 for rows left out."""
        return [r + 1 if ok else 0 for r, ok in enumerate(self.live_rows)]

    def token_rows(self) -> I64:
        """The batch row of every query token, in batch order."""
        return np.repeat(np.arange(self.size, dtype=np.int64), self.query)

    def token_offsets(self) -> I64:
        """Each query token's index within its row."""
        return _offsets_within(self.query)


def _offsets_within(counts: I64) -> I64:
    """``0..c-1`` for each count c, concatenated."""
    total = int(counts.sum())
    return np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)


@dataclasses.dataclass(frozen=True)
class GroupEntries:
    """The table cells one group fills this step, in batch-row then position order: each row's verify span,
    then the cells of the step's own tokens (what attention reads for them, checked by the stamp against
    the slots they write).

    ``row``/``offset``: the batch row and the offset in its read segment each cell is filled from;
    ``position``: the token position the cell stands for; ``cells``: flat index into the
    ``(max_batch + 1, width)`` table; ``edges``: cells just before a sliding window, set to the read
    trash; ``expected_seg``: per batch row, the read-segment length the scheduler expects; ``new``: which
    cells are the step's own tokens.
    """

    row: I64
    offset: I64
    position: I64
    cells: I64
    edges: I64
    expected_seg: I64
    new: npt.NDArray[np.bool_]

    @property
    def count(self) -> int:
        return int(self.row.shape[0])


def spans(g: GroupGeometry, rows: RowPlan) -> tuple[I64, I64]:
    """Per row, the first verified position and how many cells the row fills (0 for a row left out).  Full
    group: positions ``0..past+query-1``; sliding group: the last ``W - 1`` past ones and the query's (see
    :mod:`.translate`).  The read segment holds exactly these, in this order."""
    past = rows.past
    starts = np.maximum(past - g.canary_window, 0) if g.is_sliding else np.zeros_like(past)
    counts = np.where(rows.live, past - starts + rows.query, 0)
    if int(counts.sum()) >= MAX_ENTRIES:
        raise ValueError(f"group {g.name!r}: {int(counts.sum())} table cells in one step, more than {MAX_ENTRIES}")
    return starts, counts


def group_entries(g: GroupGeometry, rows: RowPlan, width: int) -> GroupEntries:
    """Every cell of :func:`spans`, one array element per cell."""
    past = rows.past
    starts, counts = spans(g, rows)
    row = np.repeat(np.arange(rows.size, dtype=np.int64), counts)
    offset = _offsets_within(counts)
    position = starts[row] + offset
    cells = (row + 1) * width + position
    if g.is_sliding:
        has_edge = np.flatnonzero((starts > 0) & (counts > 0))
        edges = (has_edge + 1) * width + starts[has_edge] - 1
    else:
        edges = np.zeros(0, dtype=np.int64)
    new = position >= past[row]
    return GroupEntries(row, offset, position, cells, edges, past - starts + rows.query, new)


def trash_writes(g: GroupGeometry, rows: RowPlan, n: int) -> npt.NDArray[np.bool_] | None:
    """Mask over the first ``n`` write entries: the first ``query - W`` tokens of each row of a sliding
    group, which transformers sends to the write trash by design; None when there is none."""
    flags = _trash_flags(g, rows, n, n)
    return None if flags is None else np.frombuffer(flags, dtype=np.bool_)


def trash_bytes(g: GroupGeometry, rows: RowPlan, n: int, length: int) -> memoryview:
    """:func:`trash_writes` as ``length`` bools (``length`` >= ``n``; the rest False): the one-launch path stages it
    at a fixed size, so a step with trash and one without bind the same launch."""
    mask = trash_mask(g, rows, n, length)
    return typing.cast(memoryview, memoryview(bytearray(length)).cast("?")) if mask is None else mask


def trash_mask(g: GroupGeometry, rows: RowPlan, n: int, length: int) -> memoryview | None:
    """:func:`trash_bytes`, or None where it is all False (no query overflows the window: most steps)."""
    flags = _trash_flags(g, rows, n, length)
    return None if flags is None else typing.cast(memoryview, memoryview(flags).cast("?"))  # as Pack reads bools


def _trash_flags(g: GroupGeometry, rows: RowPlan, n: int, length: int) -> bytearray | None:
    """:func:`trash_writes` as ``length`` bytes of 0 or 1 (``length`` >= ``n``), or None where there is none; plain
    Python, no numpy: a steady prefill chunk builds it with the caches cold."""
    window = g.sliding_window
    if not g.is_sliding or max(rows.query_lens, default=0) <= window:
        return None
    out = bytearray(length)
    start = 0  # the row's first write entry (the rows' tokens in batch order)
    for q in rows.query_lens:
        stop = min(start + q - window, n)  # its first q - W entries
        if stop > start:
            out[start:stop] = b"\x01" * (stop - start)
        start += q
    return out


def ring_wraps(windows: Sequence[int], rows: RowPlan) -> int:
    """Over the sliding groups' ``windows`` W, the stored writes at positions >= W: each overwrote the ring slot of
    position - W.  A row stores its query's last W writes, ``[end - min(q, W), end)``.  Plain Python with no
    calls: it runs every step of a sliding model, per row.  A decode step (every row in the table, one token each)
    counts in C: there a row wraps once a window exactly when its past reaches the window."""
    past, query = rows.past_lens, rows.query_lens
    if past and min(query) == 1 == max(query) and all(rows.live_rows):
        ordered = sorted(past)  # windows are at least 2 tokens, so a token's write is always stored
        return sum(len(ordered) - bisect.bisect_left(ordered, window) for window in windows)
    wraps = 0
    for window in windows:
        for p, q, ok in zip(rows.past_lens, rows.query_lens, rows.live_rows, strict=True):
            end = p + q
            stored_from = end - (q if q < window else window)
            stored_from = stored_from if stored_from > window else window
            if ok and end > stored_from:
                wraps += end - stored_from
    return wraps


@dataclasses.dataclass(frozen=True)
class BlockLookups:
    """Decode fast path: for each write then each verified entry, the block-table cell and page offset."""

    bt_row: I64  # clamped into the table
    bt_col: I64
    page_offset: I64
    in_table: npt.NDArray[np.bool_]  # row and page inside the block table, position >= 0


def block_lookups(g: GroupGeometry, rows: RowPlan, entries: GroupEntries, bt_shape: tuple[int, int]) -> BlockLookups:
    n_rows, n_cols = bt_shape
    brow = np.concatenate([rows.token_rows(), entries.row])
    pos = np.concatenate([rows.past[rows.token_rows()] + rows.token_offsets(), entries.position])
    page = np.floor_divide(pos, g.page_size)
    ok = (brow < n_rows) & (page < n_cols) & (pos >= 0)
    return BlockLookups(
        bt_row=np.clip(brow, 0, max(n_rows - 1, 0)),
        bt_col=np.clip(page, 0, max(n_cols - 1, 0)),
        page_offset=np.remainder(pos, g.page_size),
        in_table=ok,
    )
