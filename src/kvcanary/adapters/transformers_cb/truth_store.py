"""The ground truth of the requests being served, kept on the device between steps.

Each step needs, per batch row, the tokens the scheduler believes sit at positions ``0 .. n - 1`` of its
request (the canary checks every verified entry and every written token against them).  Rebuilding and
sending that whole table every step cost host time in proportion to the whole context (about 90 ms a step
at 256 requests of 4k tokens).  Here each request keeps a row of a persistent device table; a step sends
only each request's newest tokens -- the ones it has not sent yet, plus those of the last
:data:`REFRESH` that differ from what was sent for them, so a rewind or rewrite of recent history (a
rolled-back token) still reaches the device -- and the step's truth is gathered from the persistent rows on
the device.  The host keeps a mirror of each request's last ``REFRESH`` tokens as sent, to compare with.
The engine capture's :class:`History` copies the newest ``REFRESH`` tokens plus the step's query, so that a step
reads every token it compares and sends from that copy (cheap), not from the engine's lists.

Rows are reused least recently used first (when none is free, half of the idle ones are freed at once); a request
that comes back after losing its row is sent whole.
The table has ``max_batch`` rows (every request of a batch holds one) plus row 0, never written: the
padding row's and the rows-left-out truth.
"""

from __future__ import annotations

import array
import dataclasses
from collections.abc import Sequence

import torch

from kvcanary.adapters.transformers_cb.batch_shapes import RecurringViews, pad_rows
from kvcanary.adapters.transformers_cb.host_batch import REFRESH, History, HostBatch
from kvcanary.schema import UNKNOWN_TOKEN

_KEPT = 4 * REFRESH  # a request's sent window kept as built up to this length, else cut to its last REFRESH


class TruthUpdate:
    """One step's host side: where each batch row's truth lives, its valid length, and the cells to write (int64
    arrays, the tokens int32: plain ``array.array``, built without numpy, see :func:`.batch_shapes.pad_rows`).  A
    plain slotted class, not a frozen dataclass: it is built every step with the caches cold, and a frozen
    dataclass's initialiser goes through a path nothing else on the step touches."""

    __slots__ = ("cells", "gather", "lens", "tokens", "width")

    def __init__(
        self, gather: array.array[int], lens: array.array[int], width: int, cells: array.array[int],
        tokens: array.array[int],
    ) -> None:  # fmt: skip
        self.gather = gather  # store row of table row t (t = 0: row 0), b + 1 entries
        self.lens = lens  # valid truth length per batch row (0 for rows left out)
        self.width = width  # columns the step's truth needs (at least 1)
        self.cells = cells  # flat cells of the store to write
        self.tokens = tokens  # their tokens (int32)

    def padded(self, rows: int) -> TruthUpdate:
        """The update for a batch padded to ``rows`` rows (see
        :mod:`~kvcanary.adapters.transformers_cb.batch_shapes`): padding rows gather row 0, with length 0."""
        return TruthUpdate(
            pad_rows(self.gather, rows + 1), pad_rows(self.lens, rows), self.width, self.cells, self.tokens
        )


class TruthStore:
    def __init__(self, rows: int, width: int, device: torch.device, *, static_out: bool = False) -> None:
        """``static_out``: each step's truth is gathered into one persistent buffer at full width (a fixed address
        and shape for a given batch size; the valid lengths bound every read, so the width changes nothing)."""
        if rows <= 0 or width <= 0:
            raise ValueError(f"rows and width must be positive, got {rows} and {width}")
        self.width = width
        self.table = torch.full((rows + 1, width), UNKNOWN_TOKEN, dtype=torch.int32, device=device)
        self._out = torch.empty_like(self.table) if static_out else None
        self._out_rows: RecurringViews[torch.Tensor] = RecurringViews()
        self._flat = self.table.view(-1)
        self._rows = rows
        self._sent: dict[str, _Sent] = {}
        self._plans = 0  # steps planned: each request's last one is its entry's stamp (least recently used first)
        self._free = list(range(rows, 0, -1))

    def forget(self) -> None:
        """Forget what was sent: every request is sent whole at its next step.  For a step whose deferred write
        (:meth:`scatter`) may not have run."""
        self._sent.clear()
        self._free = list(range(self._rows, 0, -1))

    def plan(self, host: HostBatch, live: Sequence[bool]) -> TruthUpdate:
        """What to send for ``host`` (rows with ``live`` False get row 0 and length 0)."""
        # One pass of plain Python over the rows, no numpy and no calls in the usual row: it runs every step for
        # every request, with the CPU caches cold (see batch_shapes.pad_rows).
        width, refresh, sent_map = self.width, REFRESH, self._sent
        find = sent_map.get
        self._plans += 1
        stamp = self._plans
        gather = [0]  # table row 0, then per batch row its store row (0: left out)
        lens: list[int] = []  # per batch row: its valid length
        cells: list[int] = []
        tokens: list[int] = []
        truth: Sequence[History]
        if host.histories:
            truth = host.truth  # type: ignore[assignment]  # the engine's capture: every entry a History
        else:  # built by hand (tests, benchmarks): each row as a History, once
            truth = tuple(h if type(h) is History else History([int(t) for t in h], ()) for h in host.truth)
        for rid, h, ok in zip(host.request_ids, truth, live, strict=True):
            if not ok:
                gather.append(0)
                lens.append(0)
                continue
            entry = find(rid)
            if entry is None:
                entry = sent_map[rid] = _Sent(self._take_row(host.request_ids), width)
            entry.used = stamp
            # Plain statements, no tuple assignments or conditional expressions: fewer bytecodes in the usual row.
            n = h.size
            if n > width:
                n = width
            stop = entry.n  # the compared window: REFRESH positions before stop
            if stop > n:
                stop = n
            start = stop - refresh if stop > refresh else 0
            at = h.tail_start
            if start >= at:  # the usual row: the window and the new tokens are in the history's tail, no copy kept
                tail = h.tail
                base = entry.base
                if (
                    stop > start
                    and start >= entry.start
                    and tail[start - at : stop - at] == entry.sent[start - base : stop - base]
                ):
                    first = stop  # the usual step: nothing resent
                else:
                    first = start + entry.same_prefix(start, stop, tail[start - at : n - at])
                if n - first == 1:  # one new token (a decode step): no slice, no range
                    tokens.append(tail[n - at - 1])
                    cells.append(entry.cell0 + first)
                else:
                    tokens += tail[first - at : n - at]
                    cells += range(entry.cell0 + first, entry.cell0 + n)
                entry.n = n
                entry.start = start
                entry.base = at
                entry.sent = tail
            else:  # a long first send, or a window older than the tail: read from the engine's lists
                new = h.tokens(start, n)
                skip = entry.same_prefix(start, stop, new)
                tokens += new[skip:] if skip else new
                row_at = entry.cell0
                cells += range(row_at + start + skip, row_at + n)
                if n - start > _KEPT:  # keep its last REFRESH only
                    start, new = n - refresh, new[-refresh:]
                entry.n, entry.start, entry.base, entry.sent = n, start, start, new
            gather.append(entry.row)
            lens.append(n)
        return TruthUpdate(
            gather=array.array("q", gather),
            lens=array.array("q", lens),
            width=max(lens, default=0) or 1,
            cells=array.array("q", cells),
            tokens=_int32(tokens),
        )

    def apply(
        self, update: TruthUpdate, cells: torch.Tensor, tokens: torch.Tensor, gather: torch.Tensor
    ) -> torch.Tensor:
        """Write the update (its arrays on the device) and return the step's truth, ``(b + 1, width)``."""
        self.write(update, cells, tokens)
        if self._out is not None:
            return torch.index_select(self.table, 0, gather, out=self._out[: int(gather.shape[0])])
        return torch.index_select(self.table[:, : update.width], 0, gather)

    def write(self, update: TruthUpdate, cells: torch.Tensor, tokens: torch.Tensor) -> None:
        """The update's new tokens into the store (enqueued now)."""
        if update.cells:
            self._flat.index_copy_(0, cells, tokens)

    @property
    def static(self) -> bool:
        """Whether each step's truth lands in one persistent buffer (then :meth:`deferred` applies)."""
        return self._out is not None

    def scatter(self, words: torch.Tensor, halves: torch.Tensor, meta: torch.Tensor) -> TruthScatter:
        """:meth:`write` as device work for the prelude (see :class:`TruthScatter`)."""
        return TruthScatter(self._flat, words, halves, meta)

    def deferred(self, gather: torch.Tensor) -> TruthGather:
        """The step's truth gather as a unit to run later (and to replay), after :meth:`write`: a static store only.

        Only the gather joins the canary's step graph: its shape follows the batch's rows, while the number of
        tokens written varies with how much history the step's requests send (a request's first step sends all
        of it), and a key per write count left a tenth of the GPU demo's steps running eagerly."""
        if self._out is None:
            raise RuntimeError("a truth store without a static output cannot defer its gather")
        out, n = self._out, int(gather.shape[0])
        return TruthGather(self.table, gather, self._out_rows.get(n, lambda: out[:n]))

    def _take_row(self, batch_ids: Sequence[str]) -> int:
        if not self._free:
            self._evict(batch_ids)
        return self._free.pop()

    def _evict(self, batch_ids: Sequence[str]) -> None:
        """No row is free: free the least recently used half of the rows no request of this batch holds (at least
        one), least recently used taken first.  One scan for the joins of many steps: scanning every row for each
        join cost a few hundred bytecodes a step in a serving loop, where requests join every few steps and the
        rows of the finished ones are never asked for again."""
        in_batch = set(batch_ids)
        idle = sorted([(entry.used, rid) for rid, entry in self._sent.items() if rid not in in_batch])
        if not idle:
            raise RuntimeError("the truth store has fewer rows than the batch has requests")
        for _, rid in reversed(idle[: max(1, len(idle) // 2)]):
            self._free.append(self._sent.pop(rid).row)


@dataclasses.dataclass(frozen=True)
class TruthGather:
    """One step's truth gather on the device, with its tensors bound: the batch's rows of the store copied into
    ``out``.  Part of the translation's prelude (see :class:`kvcanary.runtime.step_graphs.Prelude`): its
    addresses and shapes depend on the batch's rows only, so it replays inside the canary's step graph."""

    table: torch.Tensor
    gather: torch.Tensor
    out: torch.Tensor

    @property
    def key(self) -> tuple[object, ...]:
        return tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in (self.table, self.gather, self.out))

    def run(self) -> None:
        torch.index_select(self.table, 0, self.gather, out=self.out)


SCATTER_BLOCK = 1024


def scatter_meta(count: int, cells_at: int, tokens_at: int) -> array.array[int]:
    """What :class:`TruthScatter` stages beside the writes: their count and where their cells (int64) and tokens
    (int32) start, from the byte offsets ``cells_at`` and ``tokens_at`` into the staging buffer."""
    return array.array("q", (count, cells_at // 8, tokens_at // 4))


@dataclasses.dataclass(frozen=True)
class TruthScatter:
    """One step's truth write as device work that stays the same from step to step (its count and where its
    arrays sit are staged in ``meta``; see ``ops/kernels/truth_scatter.py``), so it joins the step graph: the
    prelude runs it before the gather.  ``words``/``halves``: the whole staging buffer as int64 and int32."""

    table: torch.Tensor  # the store, flat
    words: torch.Tensor
    halves: torch.Tensor
    meta: torch.Tensor  # count, the cells' int64 offset, the tokens' int32 offset

    @property
    def key(self) -> tuple[object, ...]:
        return tuple((t.data_ptr(), tuple(t.shape)) for t in (self.table, self.words, self.halves, self.meta))

    def run(self) -> None:
        from kvcanary.ops.kernels.truth_scatter import truth_scatter_kernel

        n_words, n_halves = int(self.words.shape[0]), int(self.halves.shape[0])
        grid = (-(-n_words // SCATTER_BLOCK),)  # one int64 cell an entry: never more entries than words
        truth_scatter_kernel[grid](
            self.table, self.words, self.halves, self.meta, int(self.table.shape[0]), n_words, n_halves,
            BLOCK=SCATTER_BLOCK,
        )  # fmt: skip


class _Sent:
    """A request's store row, how many of its tokens the row holds, and the tokens last compared or sent: ``sent``
    holds positions ``base ..`` (the history's tail as the step read it, kept as it is: no copy), of which
    ``start`` up to ``n`` are the window the row was last compared with or sent."""

    __slots__ = ("base", "cell0", "n", "row", "sent", "start", "used")

    def __init__(self, row: int, width: int) -> None:
        self.row, self.n, self.start, self.base, self.used = row, 0, 0, 0, 0
        self.cell0 = row * width  # the store's flat cell of the row's position 0
        self.sent: list[int] = []

    def same_prefix(self, start: int, stop: int, tokens: list[int]) -> int:
        """How many of ``tokens`` (positions ``start ..``) before ``stop`` the row already holds as they are."""
        m, off = stop - start, start - self.base
        if m <= 0 or start < self.start:  # before the window compared last: a rewind past it; send everything
            return 0
        if tokens[:m] == self.sent[off : off + m]:
            return m
        return next(i for i in range(m) if tokens[i] != self.sent[off + i])


def _int32(tokens: list[int]) -> array.array[int]:
    """The tokens' low 32 bits, as the records keep them."""
    try:
        return array.array("i", tokens)
    except OverflowError:  # an id outside int32 (never a real vocabulary's): wrapped, as a cast would
        return array.array("i", [(t + (1 << 31)) % (1 << 32) - (1 << 31) for t in tokens])
