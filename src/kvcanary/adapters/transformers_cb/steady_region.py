"""What a steady step stages (see :mod:`.steady_step`), written where the last full step packed it.

A steady step's staged arrays sit at the offsets the full step gave them: first the arrays every group shares (the
per-row ones, the index sizes; see :func:`.step_buffers.pack_common`), then the truth's meta, then each sliding
group's trash mask (the class's token count of bools), then the truth's writes, whose count varies. All but the
writes are int64, padded to the shape class's rows, and change only in a few values (each row's table row and
lengths, the truth's lengths and rows, the sizes, the meta), so they are kept as one int64 array laid out as the
staging buffer's first bytes: a step sets those values in place (padding rows back to zero where its batch is
smaller than the full step's) and sends that array and the writes behind it in one copy. That skips building and
checking each array every step, which in a serving loop runs with every CPU cache cold (each distinct call costs
microseconds there; see :mod:`.staging`).
"""

from __future__ import annotations

import array
from collections.abc import Sequence

from kvcanary.adapters.transformers_cb.staging import Pack, Staging, aligned
from kvcanary.adapters.transformers_cb.truth_store import TruthUpdate, scatter_meta

# The staged arrays a steady step rewrites, in the order the full step packs them (they lead the pack).
REGION_ARRAYS = ("rows", "prefix", "extend", "truth_lens", "truth_gather", "sizes", "truth_meta")


class StagedRegion:
    """The leading int64 arrays of a full step's pack, kept to be set and sent again by the steady steps after it."""

    __slots__ = (
        "_at", "_bytes", "_generation", "_masked", "_meta", "_n_rows", "_n_set", "_row_ids", "_sizes", "_trash",
        "_words", "_zeros",
    )  # fmt: skip

    def __init__(self, pack: Pack, common: dict[str, int], generation: int, windows: Sequence[int] = ()) -> None:
        """``common``: each array's index in ``pack`` by name; ``generation``: the staging's (see
        :attr:`.staging.Staging.generation`) when the pack was sent; ``windows``: the sliding groups' trash masks'
        indices in ``pack`` (right after the meta)."""
        order = [common[name] for name in REGION_ARRAYS]
        if order + list(windows) != list(range(len(REGION_ARRAYS) + len(windows))):
            raise ValueError(f"the steady arrays must lead the pack in the order {REGION_ARRAYS}, got {order}")
        if any(pack.mems[i].itemsize != 8 for i in order) or any(pack.mems[i].format != "?" for i in windows):
            raise ValueError("the steady arrays must be int64 (the trash masks bool)")
        at = [pack.offsets[i] // 8 for i in order]
        last = (order + list(windows))[-1]  # the truth's writes follow it
        self._words = array.array("q", bytes(pack.offsets[last] + aligned(pack.mems[last].nbytes)))
        self._bytes = memoryview(self._words).cast("B")
        self._trash = [(pack.offsets[i], pack.mems[i].nbytes) for i in windows]
        self._masked = [True] * len(windows)  # whether a mask may hold a True (else all False: nothing to clear)
        for i in order + list(windows):
            off, m = pack.offsets[i], pack.mems[i]
            self._bytes[off : off + m.nbytes] = m.cast("B")
        self._at = at[:5]  # rows, prefix, extend, truth_lens, truth_gather
        self._sizes, self._meta = at[5], at[6]
        self._n_rows = n_rows = pack.mems[order[0]].nbytes // 8  # the class's rows (the per-row arrays' length)
        self._row_ids = array.array("q", range(1, n_rows + 1))  # table row r + 1 for batch row r
        self._zeros = array.array("q", bytes(8 * (n_rows + 1)))
        self._generation = generation
        # The rows the words hold now (the full step's: every row of a kept step is in the table, so its table rows
        # are r + 1, nonzero, then padding): a step with as many only sets their values.
        self._n_set = sum(1 for r in self._words[at[0] : at[0] + n_rows] if r)

    def send(
        self, staging: Staging, lengths: tuple[Sequence[int], Sequence[int]], truth: TruthUpdate,
        sizes: array.array[int], trash: Sequence[memoryview | None] = (),
    ) -> bool:  # fmt: skip
        """Set the step's values (its rows' table rows and ``lengths``, past and query, every row in the table: the
        full path lays out rows left out; the truth's lengths, store rows and writes; the index sizes; each sliding
        group's trash mask as :func:`.step_plan.trash_mask` builds it, None for all False) and send them with the
        truth's writes; False, sending nothing, when the staging moved since the full step (its views are not the
        ones kept), the batch has more rows than the class, a mask is not the class's token count long, or the
        writes do not fit the staging."""
        words, n_rows = self._words, self._n_rows
        past, query = lengths
        n = len(past)
        cells_at = len(self._bytes)
        tokens_at = cells_at + aligned(8 * len(truth.cells))
        end = tokens_at + 4 * len(truth.tokens)
        if staging.generation != self._generation or end > staging.capacity or n > n_rows:
            return False
        if trash and any(m is not None and m.nbytes != size for m, (_, size) in zip(trash, self._trash, strict=True)):
            return False
        at_rows, at_past, at_query, at_lens, at_gather = self._at
        words[at_past : at_past + n] = array.array("q", past)
        words[at_query : at_query + n] = array.array("q", query)
        words[at_lens : at_lens + n] = truth.lens
        words[at_gather : at_gather + n + 1] = truth.gather  # row 0's entry first
        before = self._n_set
        if n > before:  # new rows: their table rows
            words[at_rows + before : at_rows + n] = self._row_ids[before:n]
        elif n < before:  # rows gone: back to padding (no table row, no lengths, store row 0)
            gap = self._zeros[: before - n]
            for at in (at_rows, at_past, at_query, at_lens, at_gather + 1):
                words[at + n : at + before] = gap
        self._n_set = n
        words[self._sizes : self._sizes + len(sizes)] = sizes
        words[self._meta : self._meta + 3] = scatter_meta(len(truth.cells), cells_at, tokens_at)
        for i, (mask, (off, size)) in enumerate(zip(trash, self._trash, strict=True)):
            if mask is not None:
                self._bytes[off : off + size] = mask.cast("B")
            elif self._masked[i]:
                self._bytes[off : off + size] = bytes(size)
            self._masked[i] = mask is not None
        staging.send_at(self._bytes, ((cells_at, truth.cells), (tokens_at, truth.tokens)), end)
        return True
