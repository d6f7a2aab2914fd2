"""Per step: the forward kwargs attention received + the host's view of the batch -> one StepBatch per group.

The table is adapter-owned: row ``r + 1`` belongs to batch row ``r`` for this step only (row 0 is the
padding row) and is filled, over the span the canary verifies and the step's own tokens, from the
request's segment of ``read_index[g]`` as delimited by ``cu_seq_lens_k`` -- exactly what the attention
layers gather.  A wrong read index therefore shows up as a wrong slot.  A segment whose length differs
from what the scheduler expects (``past + query`` for full attention, ``min(past, W - 1) + query`` for a
window of W) fills the row with an out-of-range slot, so a mis-delimited batch is reported instead of
trusted.

Sliding groups: the canary window is ``W - 1`` (the past tokens attention reads); the entry just before
the window is set to the read-trash slot, a reserved slot, so the first read token's link is not checked
against a predecessor attention never reads (its position and token still are).  Writes of a query
longer than the window go to the write trash by design; those map to ``NOT_STORED``.

The decode fast path (flash ``block_table``, GPU only) is translated from the block table instead.

The step's own tokens: the core checks their writes in the same step (a write into a slot read live
this step, a slot written twice) and their read entries (``CanaryGroup.checks_new_reads``): each cell of
a new token must resolve to the slot the token writes.  A full group reads the new tokens back from the
slots it just wrote; a sliding group reads them through the sentinel, a reserved slot, which is exempt.
A read index that sends one of the new tokens elsewhere is therefore reported at its own step
(``new_read_mismatch``).

Cost: what follows from the host's lengths is computed on the host (:mod:`.step_plan`) and sent in one copy
(:mod:`.staging`) with each request's newest truth tokens (:mod:`.truth_store`); a step of the last one's shape
class reuses its translation (:mod:`.steady_step`); nothing reads a device value back."""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvcanary.adapters.transformers_cb import step_plan, torch_path, translate_kernel
from kvcanary.adapters.transformers_cb.batch_shapes import (
    RecurringViews,
    ShapeClasses,
    StepShape,
    flat,
    forward_padded,
    forward_tokens,
)
from kvcanary.adapters.transformers_cb.geometry import GroupGeometry
from kvcanary.adapters.transformers_cb.host_batch import HostBatch
from kvcanary.adapters.transformers_cb.staging import Pack, Staging
from kvcanary.adapters.transformers_cb.steady_region import REGION_ARRAYS, StagedRegion
from kvcanary.adapters.transformers_cb.steady_step import KeptSteps, SteadyStep, engine_reading, engine_tensors
from kvcanary.adapters.transformers_cb.step_buffers import StableWrites, index_sizes, pack_common
from kvcanary.adapters.transformers_cb.torch_path import GroupWork
from kvcanary.adapters.transformers_cb.translation import Translation
from kvcanary.adapters.transformers_cb.truth_store import TruthStore, TruthUpdate, scatter_meta
from kvcanary.batch import StepBatch
from kvcanary.runtime.pump import CopyFence

_TRUTH_ARRAYS = ("truth_cells", "truth_tokens", "truth_gather")  # the truth update's staged arrays, in order


class StepTranslator:
    """Static tables for one bound cache; :meth:`translate` fills them for each step."""

    def __init__(
        self,
        geometries: Sequence[GroupGeometry],
        *,
        max_batch: int,
        max_context: int,
        device: torch.device | str,
        kernel: bool | None = None,
        max_tokens: int | None = None,
        bucket: bool | None = None,
        static: bool | None = None,
    ) -> None:
        """``kernel``: translate the read-index path with one Triton launch a group (default: on CUDA).
        ``bucket``: pad each step's batch to a shape class (:mod:`.batch_shapes`; default: on CUDA, where the
        step graphs key on shapes), its tokens too when ``max_tokens`` (the canary's capacity) is given.
        ``static``: outputs at fixed addresses, the truth's write and gather deferred to the prelude (default: on
        CUDA; on the CPU for tests and the host-cost benchmark)."""
        if max_batch <= 0 or max_context <= 0:
            raise ValueError(f"max_batch and max_context must be positive, got {max_batch} and {max_context}")
        self.geometries = tuple(geometries)
        self._windows = [(i, g) for i, g in enumerate(self.geometries) if g.is_sliding]  # the sliding groups
        self._window_sizes = [g.sliding_window for _, g in self._windows]
        self._narrowest = min(self._window_sizes, default=0)
        self.max_batch = max_batch
        self.width = max_context
        self.device = torch.device(device)
        shape = (max_batch + 1, max_context)
        self.tables = {g.name: torch.zeros(shape, dtype=torch.int32, device=self.device) for g in self.geometries}
        self._cells = {name: t.view(-1) for name, t in self.tables.items()}  # the scatter target
        self._staging = Staging(self.device)
        self._views: RecurringViews[torch.Tensor] = RecurringViews()
        # On CUDA every batch tensor keeps its address for a given batch shape, so the canary's own step graphs
        # (kvcanary.runtime.step_graphs) replay instead of launching each kernel: static outputs.
        static = self.static = self.device.type == "cuda" if static is None else static
        self._truth = TruthStore(max_batch, max_context, self.device, static_out=static)  # kept between steps
        self._stable = StableWrites(self.device) if static else None
        self.kernel = static if kernel is None else kernel  # the read-index path in one Triton launch
        self.bucket = static if bucket is None else bucket  # this and max_tokens: settable after construction
        self._kept = KeptSteps()  # by shape class: what a steady step reuses
        self._classes = ShapeClasses(max_batch)
        self.steady_steps = 0  # steps that did
        self.max_tokens = max_tokens or 0

    # ------------------------------------------------------------------ entry point

    def translate(self, kwargs: Mapping[str, Any], host: HostBatch, *, defer: bool = False) -> Translation:
        """The step's batches.  ``defer``: the truth gather (a static store's) and the one-launch groups' launches
        are returned as ``Translation.prelude`` instead of run; the batches are filled once it has run."""
        keeps = defer and self.kernel and self._truth.static  # the layout whose steps may be steady
        again = self._again(kwargs, host) if keeps else None
        if again is not None:
            return again
        b = host.batch_size
        n_tok, padded = forward_tokens(kwargs, host, self.max_batch)
        rows = step_plan.RowPlan.of(host, self.width)
        shape_class = self._classes.of(b, n_tok, self.bucket, self.max_tokens)  # rows and tokens, rounded up
        engine = engine_tensors(kwargs, self.geometries) if keeps else None
        shape = self._shape(b, kwargs, n_tok)
        sizes = index_sizes(kwargs, self.geometries, n_tok)
        truth = self._truth.plan(host, rows.live_rows)  # the store's state moves on
        truth = truth.padded(shape.rows) if self.bucket else truth
        pack = Pack()
        common = pack_common(pack, rows, truth, sizes, shape.rows)  # the arrays every group shares
        one_launch = self.kernel and kwargs.get("block_table") is None
        work = [
            torch_path.plan_group(
                g, rows, kwargs, pack, (sizes[3 * i], sizes[3 * i + 1], host.num_tokens),
                one_launch=one_launch, width=self.width,
            )
            for i, g in enumerate(self.geometries)
        ]  # fmt: skip
        scatter = defer and self._truth.static
        trash = [(w, step_plan.trash_bytes(w.geometry, rows, w.n_write, shape.tokens)) for w in work if w.windowed]
        dev = self._send(pack, common, truth, scatter=scatter, trash=trash)
        kernels = all(w.path == "kernel" for w in work)
        launches: list[translate_kernel.Launch] = [*self._staging.uploads(scatter and kernels)]  # slotted: first
        launches += [self._scatter(dev[common["truth_meta"]])] if scatter else []
        truth_table = self._truth_table(truth, [dev[common[k]] for k in _TRUTH_ARRAYS], defer, launches)
        batches = self._batches(work, kwargs, dev, common, (shape, truth_table, b, n_tok), launches, defer)
        tr = Translation(
            batches=batches,
            request_ids=host.request_ids,
            rows_too_long=rows.rows_too_long,
            ring_wraps=step_plan.ring_wraps(self._window_sizes, rows),
            padded=padded,
            block_table=kwargs.get("block_table") is not None,
            prelude=translate_kernel.Launches(tuple(launches)) if launches else None,
        )
        if engine is not None and not rows.rows_too_long and kernels:
            windows = [w.arrays["trash"] for w, _ in trash]
            views = tuple([dev[common[k]] for k in REGION_ARRAYS] + [dev[i] for i in windows])
            region = functools.partial(StagedRegion, pack, common, self._staging.generation, windows)
            self._kept.keep(SteadyStep.of(tr, engine, views, region, shape_class, self._kept.get(shape_class)))
        return tr

    def _batches(
        self,
        work: list[GroupWork],
        kwargs: Mapping[str, Any],
        dev: list[torch.Tensor],
        common: dict[str, int],
        step: tuple[StepShape, torch.Tensor, int, int],
        launches: list[translate_kernel.Launch],
        defer: bool,
    ) -> dict[str, StepBatch]:
        """Each group's batch: its table cells written (by a launch appended to ``launches``, run unless ``defer``)
        and its tensors.  ``step``: the token buffers, the truth table, the batch size and the token count."""
        shape, truth_table, b, n_tok = step
        batches: dict[str, StepBatch] = {}
        lengths = (dev[common["rows"]], dev[common["prefix"]], dev[common["extend"]])
        copy_tokens = self.kernel  # the tokens go to the translator's own buffers: the first launch copies them
        for i, w in enumerate(work):
            if w.path == "kernel":
                staged = (lengths, self._group_sizes(dev[common["sizes"]], i))
                tokens = translate_kernel.token_copy(kwargs, shape.input_ids, shape.positions) if copy_tokens else None
                copy_tokens = False
                out_loc = self._kernel_writes(w, kwargs, dev, staged, shape.tokens, launches, tokens)
                if not defer:
                    launches.pop().run()
            else:
                out_loc = self._group_writes(w, kwargs, b, dev, shape.tokens)
            batches[w.geometry.name] = StepBatch(
                rows=dev[common["rows"]],
                prefix_lens=dev[common["prefix"]],
                extend_lens=dev[common["extend"]],
                table=self.tables[w.geometry.name],
                input_ids=shape.input_ids,
                positions=shape.positions,
                out_cache_loc=out_loc,
                truth=truth_table,
                truth_lens=dev[common["truth_lens"]],
            )
        if copy_tokens:  # no group launched the kernel this step
            shape.input_ids[:n_tok].copy_(flat(kwargs["input_ids"]))
            shape.positions[:n_tok].copy_(flat(kwargs["position_ids"]))
        return batches

    def _again(self, kwargs: Mapping[str, Any], host: HostBatch) -> Translation | None:
        """A steady step (see :mod:`.steady_step`): its values staged where its class's last full step's were, the
        kept translation of its engine buffers handed out again; None when it is not one (the full path runs, and
        reports what is wrong with the step).  One function on purpose: it runs every step with the CPU caches cold,
        where each call costs microseconds (see :mod:`.staging`)."""
        past, query = host.past_lens, host.query_lens
        b = len(past)
        if not 0 < b <= self.max_batch or len(query) != b:
            return None
        # Builtins over the rows (their loops run in C): a Python loop here cost about 10 bytecodes a row.
        if max(map(operator.add, past, query)) > self.width:
            return None  # a row the table cannot hold: the full path leaves it out
        n_query, longest = sum(query), max(query)
        reading = engine_reading(kwargs, self.geometries, b)
        if reading is None:
            return None
        signatures, sizes, n_tok = reading
        shape = self._classes.of(b, n_tok, self.bucket, self.max_tokens)
        found = None if n_query > n_tok else self._kept.find(shape, signatures)
        if found is None:
            return None
        steady, last = found
        live = (True,) * b  # every row is in the table (checked above)
        truth = self._truth.plan(host, live)
        rows: step_plan.RowPlan | None = None  # what the windows need
        trash: list[memoryview | None] = []
        if self._windows:
            rows = step_plan.RowPlan(past, query, live)
            if longest <= self._narrowest:  # no query overflows a window: no write goes to the trash by design
                trash = [None] * len(self._windows)
            else:
                trash = [step_plan.trash_mask(g, rows, sizes[3 * i], shape[1]) for i, g in self._windows]
        assert steady.region is not None  # find() checked it
        if not steady.region.send(self._staging, (past, query), truth, sizes, trash):
            self._truth.forget()  # the staging moved or is short: the full path sends every request's truth again
            steady.translations.clear()  # nothing kept binds the staging's views any more
            return None
        wraps = last.ring_wraps if rows is None else step_plan.ring_wraps(self._window_sizes, rows)
        padded = forward_padded(kwargs, b, n_tok, n_query)
        if (wraps, host.request_ids, padded) != (last.ring_wraps, last.request_ids, last.padded):
            last = last.again(host.request_ids, wraps, padded)
            steady.reused(last)
        self.steady_steps += 1
        return last

    def _send(
        self, pack: Pack, common: dict[str, int], truth: TruthUpdate, *, scatter: bool,
        trash: list[tuple[GroupWork, memoryview]],
    ) -> list[torch.Tensor]:  # fmt: skip
        """Pack the windows' trash masks and the truth's writes (last: their count varies most, and nothing a step
        graph keys on sits after them) and send; with ``scatter`` their write is a launch (:meth:`_scatter`) that
        finds them through the offsets staged with them."""
        meta = scatter_meta(0, 0, 0)
        if scatter:
            common["truth_meta"] = pack.add(meta)
        for w, mask in trash:
            w.arrays["trash"] = pack.add(mask)
        common.update(truth_cells=pack.add(truth.cells), truth_tokens=pack.add(truth.tokens))
        if scatter:  # the meta's memory is packed already: set in place
            cells, tokens = pack.offsets[common["truth_cells"]], pack.offsets[common["truth_tokens"]]
            meta[:] = scatter_meta(len(truth.cells), cells, tokens)
        return self._staging.send(pack)

    def _scatter(self, meta: torch.Tensor) -> translate_kernel.Launch:
        """The truth's write as the prelude's first launch, through the staged ``meta``."""
        return self._truth.scatter(self._staging.whole(torch.int64), self._staging.whole(torch.int32), meta)

    def follow(self, fence: CopyFence | None) -> None:
        """Tell the staging's copies have run from ``fence``: the pump's of the manager whose host steps follow each
        translation on the same stream (see :mod:`.staging`); where that manager publishes, the staging is slotted
        and each step's work uploads its bytes (the layout whose launches are deferred)."""
        self._staging.follow(fence, slotted=self.kernel and self._truth.static)

    @property
    def slotted(self) -> bool:
        """Whether each step's work uploads its own staged bytes from pinned slots (see :meth:`follow`)."""
        return self._staging.upload() is not None

    def forget_truth(self) -> None:
        """The last step's prelude may not have run (its truth write with it): resend every request's truth."""
        self._truth.forget()
        self._kept.clear()

    def _truth_table(
        self, truth: TruthUpdate, arrays: list[torch.Tensor], defer: bool, launches: list[translate_kernel.Launch]
    ) -> torch.Tensor:
        """Write the step's truth and return its table; with ``defer`` (a static store) the gather is appended to
        ``launches`` to run with them (and replay in the step graph), after the write (the scatter, already there)."""
        cells, tokens, gather = arrays
        if not (defer and self._truth.static):
            return self._truth.apply(truth, cells, tokens, gather)
        truth_gather = self._truth.deferred(gather)
        launches.append(truth_gather)
        return truth_gather.out

    def _group_sizes(self, sizes: torch.Tensor, i: int) -> torch.Tensor:
        """Group ``i``'s three staged sizes (the view recurs with the staging's)."""
        return self._views.get((sizes.data_ptr(), i), lambda: sizes[3 * i : 3 * i + 3])

    def _shape(self, b: int, kwargs: Mapping[str, Any], n_tok: int) -> StepShape:
        """The step's rows and token tensors: with the kernel, the translator's own buffers (the launch fills them),
        so padding to a shape class views nothing of the engine's."""
        ids, pos = kwargs["input_ids"], kwargs["position_ids"]
        if not self.kernel:
            if not self.bucket:
                return StepShape(b, flat(ids), flat(pos))
            return StepShape.padded(b, ids, pos, self.max_batch, self.max_tokens)
        b, n_tok = self._classes.of(b, n_tok, self.bucket, self.max_tokens)
        if self._stable is None:
            own = torch.empty(2, n_tok, dtype=torch.int64, device=self.device)
            return StepShape(b, own[0], own[1])
        return StepShape(b, self._stable.view("input_ids", n_tok), self._stable.view("positions", n_tok))

    # ------------------------------------------------------------------ device work

    def _group_writes(
        self, w: GroupWork, kwargs: Mapping[str, Any], b: int, dev: list[torch.Tensor], n_tok: int
    ) -> torch.Tensor:
        """Fill the group's table cells for this step; return its out_cache_loc (in its own buffer on CUDA)."""
        block_table, cells = kwargs.get("block_table"), self._cells[w.geometry.name]
        if block_table is not None:
            out_loc = torch_path.from_block_table(w, block_table[w.geometry.index], dev, n_tok, cells)
        else:
            out_loc = torch_path.from_read_index(w, kwargs, b, dev, n_tok, cells)
        return out_loc if self._stable is None else self._stable.writes(w.geometry.name, out_loc)

    def _kernel_writes(
        self,
        w: GroupWork,
        kwargs: Mapping[str, Any],
        dev: list[torch.Tensor],
        staged: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
        n_tok: int,
        launches: list[translate_kernel.Launch],
        tokens: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """:func:`.torch_path.from_read_index` as one kernel launch (see :mod:`.translate_kernel`), appended to
        ``launches`` and not yet run; returns the out_cache_loc it writes.  ``staged``: the row lengths and the
        group's sizes."""
        lengths, sizes = staged
        g, a = w.geometry, w.arrays
        if self._stable is not None:
            out = self._stable.view(g.name, n_tok)
        else:
            out = torch.empty(n_tok, dtype=torch.int64, device=self.device)
        trash = dev[a["trash"]] if "trash" in a else None
        launches.append(
            translate_kernel.GroupLaunch.bind(
                g, kwargs, trash=trash, out=out, lengths=lengths, sizes=sizes, cells=self._cells[g.name],
                width=self.width, tokens=tokens,
            )
        )  # fmt: skip
        return out
