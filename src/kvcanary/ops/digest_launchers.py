"""Launchers of the digest kernel: same signatures and results as :mod:`kvcanary.ops.digest_reference`.

:class:`DeviceLayout` is built once (install time): a device table of every component's address and
strides, grouped by element size; a component whose head rows are contiguous whole words is read as
64-bit words directly (the same bytes, so the same digest).  Calls check metadata on the host, never read
device values, synchronise or allocate: a step's digest work can sit in a CUDA graph.  The layout's
tensors must stay allocated (and in place) while it is used.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch

from kvcanary.batch import StepBatch
from kvcanary.digest import TILE_TOKENS, WORD_BYTES, DigestLayout, DigestWorkspace, KVComponent
from kvcanary.layout import CanaryGroup
from kvcanary.ops.digest_reference import stamp_entries, word_keys
from kvcanary.ops.kernels.digest import digest_kernel
from kvcanary.schema import NUM_COUNTERS
from kvcanary.workspace import PlanWorkspace, ViolationLog

# Words per tile row and step when elements are assembled into words (element sizes 1, 2, 4).
_ELEMENT_BLOCK_W = {4: 64, 2: 32, 1: 16}


@dataclasses.dataclass(frozen=True)
class DigestTuning:
    """Tile shape and grid of the word path (components read as 64-bit words): a work unit is one
    component of 16 entries, read ``block_words`` words per entry a step (whole head rows where they fit)
    by ``warps`` warps; ``programs_per_sm`` persistent programs per SM share the units."""

    # Defaults: the fastest of a 72-point sweep on the H200 (benchmarks/digest_sweep.py), a 28-layer bf16
    # pool: small steps keep registers low enough for several programs per SM.
    block_words: int = 64
    warps: int = 4
    programs_per_sm: int = 8
    max_comps_per_unit: int = 8
    vector: bool = True  # two-word loads where offsets allow (a switch for measuring them)
    # A launch with at most one unit per program (a decode step's stamp or budgeted verify) is a latency
    # chain, not a stream: its tile steps may be up to ``small_block_words`` words, on ``small_warps`` warps.
    # Defaults from benchmarks/results/nvidia-h200-4bbb48e-digest-steps.txt: 8 warps on the streaming tile
    # took the b1 x 4k step from 16.8 to 15.4 us; wider steps (128-512 words) were slower (18-27 us).
    small_block_words: int = 64
    small_warps: int = 8

    def __post_init__(self) -> None:
        for name in ("block_words", "small_block_words"):
            v = getattr(self, name)
            if v <= 0 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two, got {v}")
        if min(self.warps, self.small_warps, self.programs_per_sm, self.max_comps_per_unit) <= 0:
            raise ValueError("warps, small_warps, programs_per_sm and max_comps_per_unit must be positive")

    def for_units(self, units: int, programs: int) -> DigestTuning:
        """The tuning a launch of ``units`` work units on a grid of at most ``programs`` uses: this one, or
        its small-launch tile and warps when every program runs at most one unit."""
        if units > programs:
            return self
        wide = max(self.block_words, self.small_block_words)
        return dataclasses.replace(self, block_words=wide, warps=self.small_warps)

    def tile(self, heads: int, words_per_head: int) -> tuple[int, int]:
        """(heads, words of a head) a step reads: a whole head row if it fits, as many heads as fit."""
        bj = min(_pow2(words_per_head), self.block_words)
        return min(_pow2(heads), self.block_words // bj), bj


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


DEFAULT_TUNING = DigestTuning()


def _row(comp: KVComponent, base: int) -> tuple[int, list[int]]:
    """(element size the kernel reads, table row with the component's absolute address) of one component."""
    v, shape = comp.view, comp.shape
    es = v.element_size()
    s_block, s_off, s_head, s_dim = v.stride()
    if shape.block_size == 1:
        s_off = 0  # never multiplied by a non-zero offset
    if shape.heads == 1:
        s_head = 0
    addr, dim = v.data_ptr(), shape.dim
    words_ok = (s_dim == 1 or dim == 1) and (dim * es) % WORD_BYTES == 0 and addr % WORD_BYTES == 0
    if es < WORD_BYTES and words_ok and all((s * es) % WORD_BYTES == 0 for s in (s_block, s_off, s_head)):
        k = WORD_BYTES // es
        es, dim, s_block, s_off, s_head, s_dim = WORD_BYTES, dim // k, s_block // k, s_off // k, s_head // k, 1
    return es, [addr, s_block, s_off, s_head, s_dim, shape.block_size, shape.heads, dim, shape.words_per_head, base]


@dataclasses.dataclass(frozen=True)
class LaunchClass:
    """The components one launch reads (one element size) and what the kernel may assume of them."""

    element_size: int
    first: int  # first table row
    rows: int
    heads: int  # most heads of a row
    words_per_head: int  # most words per head of a row
    block_log: int  # every row's block size is 2**block_log; -1: mixed or not a power of two
    uniform: bool  # every row has these heads and words per head, and unit-stride words
    even: bool  # every word offset and stride is even (two-word loads stay aligned)

    @classmethod
    def of(cls, es: int, first: int, rows: list[list[int]]) -> LaunchClass:
        sizes = {r[5] for r in rows}
        bs = sizes.pop() if len(sizes) == 1 else 0
        heads, wph = max(r[6] for r in rows), max(r[8] for r in rows)
        uniform = all(r[6] == heads and r[8] == wph and (r[4] == 1 or r[7] == 1) for r in rows)
        even = es == WORD_BYTES and all(v % 2 == 0 for r in rows for v in (r[0], r[1], r[2], r[3], r[8], r[9]))
        block_log = bs.bit_length() - 1 if bs and bs & (bs - 1) == 0 else -1
        return cls(es, first, len(rows), heads, wph, block_log, uniform, even)

    def path(self, tuning: DigestTuning) -> tuple[int, int, bool, bool]:
        """(heads, words of a head) of a tile step, and whether tiles are exact and loads two words wide."""
        hb, bj = tuning.tile(self.heads, self.words_per_head)
        exact = self.element_size == WORD_BYTES and self.uniform and bj == self.words_per_head and self.heads % hb == 0
        return hb, bj, exact, exact and self.even and tuning.vector


@dataclasses.dataclass(frozen=True)
class DeviceLayout:
    """A :class:`DigestLayout` as the kernel reads it: one table, one launch per element size."""

    layout: DigestLayout
    table: torch.Tensor  # int64 [components, 10], rows grouped by element size; addresses relative to itself
    keys: torch.Tensor  # int64 [layout.words]: key(i) of every word index (the reference's word_keys)
    classes: tuple[LaunchClass, ...]

    @classmethod
    def build(cls, layout: DigestLayout) -> DeviceLayout:
        if layout.num_slots >= 2**31:
            raise ValueError(f"the digest kernel indexes slots as int32: {layout.num_slots} slots is too many")
        rows: dict[int, list[list[int]]] = {}
        for comp, base in zip(layout.components, layout.word_bases(), strict=True):
            es, row = _row(comp, base)
            rows.setdefault(es, []).append(row)
        table = torch.empty(len(layout.components), 10, dtype=torch.int64, device=layout.device)
        flat: list[list[int]] = []
        classes = []
        for es in sorted(rows):
            for r in rows[es]:  # words (bytes below 8-byte elements) from the table's own address
                r[0] = (r[0] - table.data_ptr()) // (WORD_BYTES if es == WORD_BYTES else 1)
            classes.append(LaunchClass.of(es, len(flat), rows[es]))
            flat.extend(rows[es])
        table.copy_(torch.tensor(flat, dtype=torch.int64))
        keys = word_keys(layout.words, layout.device)
        return cls(layout, table, keys, tuple(classes))


def _check(group: CanaryGroup, dl: DeviceLayout, digests: torch.Tensor, ws: DigestWorkspace, log: ViolationLog) -> None:
    if not isinstance(dl, DeviceLayout):
        raise TypeError(f"layout must be a DeviceLayout (DeviceLayout.build(...)), got {type(dl).__name__}")
    dev = dl.layout.device
    for name, t, dtype, shape in (
        ("digests", digests, torch.int64, (group.num_slots,)),
        ("workspace.sync", ws.sync, torch.int64, (4,)),
        ("workspace.epoch", ws.epoch, torch.int64, (1,)),
        ("workspace.stats", ws.stats, torch.int64, (4,)),
        ("workspace.entry_slots", ws.entry_slots, torch.int64, (ws.entries,)),
        ("workspace.entry_info", ws.entry_info, torch.int64, (ws.entries,)),
        ("log.counters", log.counters, torch.int64, (NUM_COUNTERS,)),
    ):
        if t.dtype != dtype or tuple(t.shape) != shape or t.device != dev or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {dtype} tensor of shape {shape} on {dev}")
    if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "the digest kernel got CPU tensors: set TRITON_INTERPRET=1 before importing kvcanary.ops.kernels"
        )


def _grid_cap(dev: torch.device, tuning: DigestTuning) -> int:
    """The persistent grid's size: programs_per_sm per SM (3 programs under the interpreter)."""
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).multi_processor_count * tuning.programs_per_sm
    return 3


def _reserved(group: CanaryGroup) -> list[int]:
    return list(group.reserved_slots) + [-1] * (CanaryGroup.MAX_RESERVED - len(group.reserved_slots))


def _launch(
    group: CanaryGroup, dl: DeviceLayout, digests: torch.Tensor, ws: DigestWorkspace, log: ViolationLog, *,
    locs: torch.Tensor | None, lookup: torch.Tensor | None, batch: StepBatch | None, plan_ws: PlanWorkspace | None,
    stamp: bool, report_range: bool, period: int, max_tiles: int, tuning: DigestTuning, and_stamp: bool = False,
) -> None:  # fmt: skip
    """One call's launches; ``and_stamp``: a planned verify that then stamps ``locs`` (verify_and_stamp)."""
    dummy = ws.sync
    n_list = 0 if locs is None else int(locs.shape[0])
    b = n_rows = n_cols = 0
    rows = table = starts = voff = state = pepoch = dummy
    wmarks: torch.Tensor = dummy
    if batch is not None and plan_ws is not None:
        b = batch.batch_size
        n_rows, n_cols = (int(s) for s in batch.table.shape)
        rows, table = batch.rows, batch.table if batch.table.numel() else dummy
        starts, voff, state = plan_ws.window_starts, plan_ws.verify_offsets, plan_ws.row_state
        pepoch, wmarks = plan_ws.epoch, plan_ws.write_marks
    max_b = int(plan_ws.row_state.shape[0]) if plan_ws is not None else 1
    block_b = max(16, 1 << max(max_b - 1, 0).bit_length())  # from the capacity: one compile for every batch
    has_lookup = lookup is not None and lookup.numel() > 0
    cap = _grid_cap(dl.layout.device, tuning)
    tiles = max_tiles if batch is None else _planned_tiles(batch, group, period, max_tiles)
    tiles += -(-n_list // TILE_TOKENS) if and_stamp else 0
    for k, lc in enumerate(dl.classes):
        es = lc.element_size
        units = tiles * lc.rows
        programs = max(1, min(units, cap))
        t = tuning.for_units(units, cap)
        hb, bj, exact, vec = lc.path(t)
        # Components per unit: more where tiles alone keep every program busy (amortizes the entries); a
        # planned verify knows only a bound on its tiles, so it keeps one (all programs in use).
        cpu = 1
        while batch is None and cpu < tuning.max_comps_per_unit and units // (2 * cpu) >= 2 * programs:
            cpu *= 2
        digest_kernel[(programs,)](
            dl.table, dl.keys, locs if locs is not None and n_list else dummy, lookup if has_lookup else dummy,
            rows if b else dummy, table, starts, voff, state, pepoch, wmarks,
            digests, ws.acc, ws.entry_slots, ws.entry_info, ws.sync, ws.epoch, ws.stats,
            log.first, log.last, log.counters,
            n_list, int(lookup.shape[0]) if has_lookup and lookup is not None else 0, b, n_rows, n_cols,
            group.page_size, min(group.num_slots, dl.layout.num_slots), period, max_tiles, lc.first, lc.rows,
            log.capacity, group.group_id, *_reserved(group),
            FROM_PLAN=batch is not None, STAMP=stamp, AND_STAMP=and_stamp, HAS_LOOKUP=has_lookup,
            PAGED=group.page_size > 1, REPORT_RANGE=report_range, FINALIZE=k == len(dl.classes) - 1, ESIZE=es,
            G=TILE_TOKENS, BLOCK_W=_ELEMENT_BLOCK_W.get(es, 1), BLOCK_B=block_b, HB=hb, BJ=bj,
            CPU=cpu, BS_LOG=lc.block_log, EXACT=exact, VEC=vec,
            num_warps=t.warps if es == WORD_BYTES else 4,
        )  # fmt: skip


def _planned_tiles(batch: StepBatch, group: CanaryGroup, period: int, max_tiles: int) -> int:
    """Most tiles a planned verify of ``batch`` selects, from its shapes (known when a graph is captured):
    a row's span lies inside its table row, so it selects at most one run in ``period`` of them (plus the
    partial runs at its ends).  It sizes the grid only: a corrupt span past its row still gets every tile,
    from fewer programs."""
    n_cols = int(batch.table.shape[1]) if batch.table.dim() == 2 else 0
    if not n_cols:
        return max_tiles
    runs = -(-n_cols * group.page_size // TILE_TOKENS) + 1
    return min(max_tiles, batch.batch_size * -(-runs // period))


def _list(
    group: CanaryGroup, layout: DeviceLayout, digests: torch.Tensor, ws: DigestWorkspace, log: ViolationLog,
    locs: torch.Tensor, *, stamp: bool, lookup: torch.Tensor | None = None, report_range: bool = False,
    tuning: DigestTuning = DEFAULT_TUNING,
) -> None:  # fmt: skip
    """digest_reference.stamp_list (``stamp``) or verify_list on device: one kernel launch, told by its STAMP flag."""
    _check(group, layout, digests, ws, log)
    if not isinstance(locs, torch.Tensor) or locs.dim() != 1 or locs.dtype not in (torch.int32, torch.int64):
        raise TypeError("locs must be a 1-D int32/int64 tensor")
    if locs.device != layout.layout.device or not locs.is_contiguous():
        raise ValueError(f"locs must be contiguous on {layout.layout.device}")
    tiles = -(-int(locs.shape[0]) // TILE_TOKENS)
    if tiles * TILE_TOKENS > ws.entries:
        raise ValueError(f"{locs.shape[0]} entries exceed the digest workspace ({ws.entries} entries)")
    _launch(
        group, layout, digests, ws, log, locs=locs, lookup=lookup, batch=None, plan_ws=None, stamp=stamp,
        report_range=report_range, period=1, max_tiles=tiles, tuning=tuning,
    )  # fmt: skip


# The reference's two list calls are one launch here, apart from the kernel's STAMP flag.
stamp_list = functools.partial(_list, stamp=True)
verify_list = functools.partial(_list, stamp=False)


def _check_planned(
    group: CanaryGroup, dl: DeviceLayout, digests: torch.Tensor, ws: DigestWorkspace, log: ViolationLog,
    batch: StepBatch, plan_ws: PlanWorkspace, period: int, group_tokens: int,
) -> None:  # fmt: skip
    _check(group, dl, digests, ws, log)
    if group_tokens != TILE_TOKENS:
        raise ValueError(f"the kernel selects runs of {TILE_TOKENS} positions, got group_tokens={group_tokens}")
    if isinstance(period, bool) or not isinstance(period, int) or period <= 0:
        raise ValueError(f"period must be a positive int, got {period!r}")
    if batch.batch_size > int(plan_ws.row_state.shape[0]):
        raise ValueError("batch larger than the plan workspace")


def verify_planned(
    group: CanaryGroup, layout: DeviceLayout, digests: torch.Tensor, ws: DigestWorkspace, log: ViolationLog,
    batch: StepBatch, plan_ws: PlanWorkspace, *, period: int, group_tokens: int = TILE_TOKENS,
    tuning: DigestTuning = DEFAULT_TUNING,
) -> None:  # fmt: skip
    """digest_reference.verify_planned on device (the batch's plan must have run)."""
    _check_planned(group, layout, digests, ws, log, batch, plan_ws, period, group_tokens)
    _launch(
        group, layout, digests, ws, log, locs=None, lookup=batch.lookup, batch=batch, plan_ws=plan_ws,
        stamp=False, report_range=False, period=period, max_tiles=ws.entries // TILE_TOKENS, tuning=tuning,
    )  # fmt: skip


def verify_and_stamp(
    group: CanaryGroup, layout: DeviceLayout, digests: torch.Tensor, ws: DigestWorkspace, log: ViolationLog,
    batch: StepBatch, plan_ws: PlanWorkspace, *, period: int, group_tokens: int = TILE_TOKENS,
    tuning: DigestTuning = DEFAULT_TUNING,
) -> None:  # fmt: skip
    """digest_reference.verify_and_stamp on device.  A decode-sized stamp shares the verify's launch (one
    finalize: most of a small step's cost is fixed latency); a stamp that fills the grid twice over (a
    prefill chunk's) streams on its own tuned path in a launch of its own, after the verify's."""
    _check_planned(group, layout, digests, ws, log, batch, plan_ws, period, group_tokens)
    taken = stamp_entries(batch, ws)
    verify_tiles = (ws.entries - taken) // TILE_TOKENS
    stamp_units = taken // TILE_TOKENS * max(lc.rows for lc in layout.classes)
    if stamp_units > 2 * _grid_cap(layout.layout.device, tuning):
        _launch(group, layout, digests, ws, log, locs=None, lookup=batch.lookup, batch=batch, plan_ws=plan_ws,
                stamp=False, report_range=False, period=period, max_tiles=verify_tiles, tuning=tuning)  # fmt: skip
        stamp_list(group, layout, digests, ws, log, batch.out_cache_loc, lookup=batch.lookup, tuning=tuning)
        return
    _launch(
        group, layout, digests, ws, log, locs=batch.out_cache_loc, lookup=batch.lookup, batch=batch,
        plan_ws=plan_ws, stamp=False, report_range=False, period=period, max_tiles=verify_tiles, tuning=tuning,
        and_stamp=True,
    )  # fmt: skip
