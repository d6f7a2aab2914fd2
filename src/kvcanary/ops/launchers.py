"""Launchers of the Triton kernels: same signatures and results as :mod:`kvcanary.ops.reference`.

Each launcher checks metadata on the host (types, shapes, devices, capacities) and raises before
anything runs (``checked=True``: the caller already did, for this batch, this step); it never reads
device values, synchronises or allocates device memory, so a whole
plan -> verify -> stamp sequence can be captured in a CUDA graph and replayed with inputs refilled in
place.  Grids come from the workspace's capacities, not from the batch's values: programs walk the
work items they find on the device and idle programs finish at once.

CPU tensors run the kernels under the Triton interpreter, which must be switched on
(``TRITON_INTERPRET=1``) before :mod:`kvcanary.ops.kernels` is first imported.

``tuning`` must be the same for the plan and the verify / stamp that use it (the plan sizes work items
with its block sizes).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from kvcanary.batch import StepBatch, validate_batch
from kvcanary.layout import CanaryGroup, RecordStore
from kvcanary.ops.kernels.plan import plan_kernel
from kvcanary.ops.kernels.stamp import stamp_kernel
from kvcanary.ops.kernels.verify import verify_kernel
from kvcanary.schema import NUM_COUNTERS, ROW_WIDTH
from kvcanary.workspace import PlanWorkspace, ViolationLog

_SYNC_WORDS = 4  # per phase: the sync scratch words of one kernel (see kernels/log.py)
_VERIFY_SYNC = 0
_STAMP_SYNC = _SYNC_WORDS
# Sync words that are 0 whenever no call runs: pending and ticket of each phase, verify's plan pending.
SYNC_CLEAR = [0, 1, 3, 4, 5]


@dataclasses.dataclass(frozen=True)
class KernelTuning:
    """Block sizes and grid shape.  Blocks are powers of two, at least PlanWorkspace.SCRATCH_BLOCK."""

    # Defaults: the best of benchmarks/results/nvidia-h200-9376e1c-sweep.txt (H200, triton 3.6).
    verify_block: int = 1024  # entries per verify item (a sliding window group uses min(this, window))
    verify_warps: int = 8
    stamp_block: int = 512  # tokens per stamp item
    stamp_warps: int = 8
    carry_block: int = 512  # tokens per step when the finalize re-sums a row's earlier tokens
    stamp_polls: int = 32  # times a stamp item re-reads its row's earlier items' flags before recomputing
    row_block: int = 1024  # batch rows per step of the plan's row walk
    programs_per_sm: int = 4  # grid = min(work items the capacities allow, this * SM count)
    interpreter_programs: int = 3  # grid under the interpreter: few, so tests stay fast
    interpreter_polls: int = 2  # the interpreter runs programs one after another: polling cannot help there
    # plan_verify is one launch up to this many rows (see fuses_plan).  Off (0) by default until the fused
    # kernel's compiled suites and memcheck have run on a GPU: it passed them only under the interpreter and
    # compiled offline for sm_90 with Triton 3.6 (its measured gain: decode b1 13.5 -> 10.9 us at 32).
    fuse_max_batch: int = 0

    def __post_init__(self) -> None:
        for name in ("verify_block", "stamp_block", "carry_block", "row_block"):
            v = getattr(self, name)
            if v < PlanWorkspace.SCRATCH_BLOCK or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= {PlanWorkspace.SCRATCH_BLOCK}, got {v}")
        for name in ("verify_warps", "stamp_warps", "programs_per_sm", "interpreter_programs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("stamp_polls", "interpreter_polls", "fuse_max_batch"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


DEFAULT_TUNING = KernelTuning()


def verify_block(group: CanaryGroup, tuning: KernelTuning = DEFAULT_TUNING) -> int:
    """Entries per verify item: a window shorter than the block would leave most lanes idle."""
    if group.window > 0:
        fit = max(PlanWorkspace.SCRATCH_BLOCK, 1 << (group.window - 1).bit_length())
        return min(tuning.verify_block, fit)
    return tuning.verify_block


# --------------------------------------------------------------------------- host-side checks


def _check_tensor(name: str, t: object, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_state(group: CanaryGroup, records: RecordStore, ws: PlanWorkspace, log: ViolationLog) -> torch.device:
    """The canary's own state: records, workspace and log on one device with consistent shapes."""
    if not isinstance(group, CanaryGroup):
        raise TypeError(f"group must be a CanaryGroup, got {type(group).__name__}")
    dev = records.links.device
    n = group.num_slots
    _check_tensor("records.tokens", records.tokens, torch.int32, (n,), dev)
    _check_tensor("records.positions", records.positions, torch.int32, (n,), dev)
    _check_tensor("records.links", records.links, torch.int64, (n,), dev)
    b = int(ws.row_state.shape[0])
    t = int(ws.mult_powers.shape[0])
    for name, dtype, shape in (
        ("verify_offsets", torch.int64, (b + 1,)),
        ("write_offsets", torch.int64, (b + 1,)),
        ("window_starts", torch.int64, (b,)),
        ("seed_links", torch.int64, (b,)),
        ("row_state", torch.int32, (b,)),
        ("mult_powers", torch.int64, (t,)),
        ("inv_powers", torch.int64, (t,)),
        ("epoch", torch.int64, (1,)),
        ("read_marks", torch.int64, (n,)),
        ("write_marks", torch.int32, (n,)),
        ("verify_items", torch.int64, (b + 1,)),
        ("write_items", torch.int64, (b + 1,)),
        ("verify_counts", torch.int32, (int(ws.verify_counts.shape[0]),)),
        ("stamp_counts", torch.int32, (int(ws.stamp_counts.shape[0]),)),
        ("stamp_sums", torch.int64, (int(ws.stamp_counts.shape[0]),)),
        ("stamp_flags", torch.int64, (int(ws.stamp_counts.shape[0]),)),
        ("sync", torch.int64, (2 * _SYNC_WORDS,)),
        ("write_old_positions", torch.int32, (max(t - 1, 1),)),
    ):
        _check_tensor(f"workspace.{name}", getattr(ws, name), dtype, shape, dev)
    k = log.capacity
    _check_tensor("log.first", log.first, torch.int64, (k, ROW_WIDTH), dev)
    _check_tensor("log.last", log.last, torch.int64, (k, ROW_WIDTH), dev)
    _check_tensor("log.counters", log.counters, torch.int64, (NUM_COUNTERS,), dev)
    if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the kernels got CPU tensors: set TRITON_INTERPRET=1 before importing kvcanary.ops.kernels")
    return dev


def _checked_device(
    group: CanaryGroup, batch: StepBatch, records: RecordStore, ws: PlanWorkspace, log: ViolationLog, checked: bool
) -> torch.device:
    """The device of the canary's state, after the host checks (``checked``: the caller -- a
    :class:`~kvcanary.canary.GroupCanary`, which allocated the state -- validated this batch this step)."""
    if not checked:
        dev = _check_state(group, records, ws, log)
        _check_batch(group, batch, ws, dev)
        return dev
    dev = records.links.device
    if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the kernels got CPU tensors: set TRITON_INTERPRET=1 before importing kvcanary.ops.kernels")
    return dev


def _check_batch(group: CanaryGroup, batch: StepBatch, ws: PlanWorkspace, dev: torch.device) -> None:
    if not isinstance(batch, StepBatch):
        raise TypeError(f"batch must be a StepBatch, got {type(batch).__name__}")
    validate_batch(
        batch,
        group,
        device=dev,
        max_batch=int(ws.row_state.shape[0]),
        max_tokens=int(ws.mult_powers.shape[0]) - 1,
        check_values=False,
    )


def _ptr(t: torch.Tensor | None, dummy: torch.Tensor) -> torch.Tensor:
    """The tensor, or a stand-in where it is absent or empty (its loads are all masked off then)."""
    return dummy if t is None or t.numel() == 0 else t


def _reserved(group: CanaryGroup) -> list[int]:
    return list(group.reserved_slots) + [-1] * (CanaryGroup.MAX_RESERVED - len(group.reserved_slots))


def _grid(max_items: int, dev: torch.device, tuning: KernelTuning) -> tuple[int]:
    if dev.type == "cuda":
        cap = torch.cuda.get_device_properties(dev).multi_processor_count * tuning.programs_per_sm
    else:
        cap = tuning.interpreter_programs
    return (max(1, min(max_items, cap)),)


def _row_block(ws: PlanWorkspace, tuning: KernelTuning) -> int:
    b = max(1, int(ws.row_state.shape[0]))
    return min(tuning.row_block, max(16, 1 << (b - 1).bit_length()))


def _truth(batch: StepBatch, dummy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int, bool]:
    if batch.truth is None or batch.truth_lens is None:
        return dummy, dummy, 0, 0, False
    t_rows, t_cols = (int(s) for s in batch.truth.shape)
    return _ptr(batch.truth, dummy), _ptr(batch.truth_lens, dummy), t_rows, t_cols, True


def _lookup(batch: StepBatch, dummy: torch.Tensor) -> tuple[torch.Tensor, int, bool]:
    if batch.lookup is None:
        return dummy, 0, False
    return _ptr(batch.lookup, dummy), int(batch.lookup.shape[0]), True


# --------------------------------------------------------------------------- the three operations


def plan(
    group: CanaryGroup,
    batch: StepBatch,
    records: RecordStore,
    ws: PlanWorkspace,
    log: ViolationLog,
    *,
    tuning: KernelTuning = DEFAULT_TUNING,
    checked: bool = False,
) -> None:
    """reference.plan on device (one program; the batch is small next to its verify work)."""
    _checked_device(group, batch, records, ws, log, checked)
    dummy = ws.sync
    lookup, n_lookup, has_lookup = _lookup(batch, dummy)
    n_rows, n_cols = (int(s) for s in batch.table.shape)
    plan_kernel[(1,)](
        _ptr(batch.rows, dummy), _ptr(batch.prefix_lens, dummy), _ptr(batch.extend_lens, dummy),
        _ptr(batch.table, dummy), lookup, records.links,
        ws.write_offsets, ws.verify_offsets, ws.window_starts, ws.seed_links, ws.row_state,
        ws.verify_items, ws.write_items, ws.epoch, log.first, log.last, log.counters,
        batch.batch_size, n_rows, n_cols, n_cols * group.page_size, n_lookup, group.num_slots, batch.num_tokens,
        group.window, int(group.padding_row is not None), group.padding_row or 0, group.page_size, log.capacity,
        group.group_id, *_reserved(group),
        PAGED=group.page_size > 1, HAS_LOOKUP=has_lookup,
        VERIFY_BLOCK=verify_block(group, tuning), STAMP_BLOCK=tuning.stamp_block,
        BLOCK_B=_row_block(ws, tuning), num_warps=4,
    )  # fmt: skip


def verify(
    group: CanaryGroup,
    batch: StepBatch,
    records: RecordStore,
    ws: PlanWorkspace,
    log: ViolationLog,
    capacity: int,
    *,
    tuning: KernelTuning = DEFAULT_TUNING,
    checked: bool = False,
) -> None:
    """reference.verify on device: entries of the last plan, up to ``capacity`` (the rest counted skipped)."""
    dev = _checked_device(group, batch, records, ws, log, checked)
    _launch_verify(group, batch, records, ws, log, capacity, tuning, dev, fused=False)


def fuses_plan(group: CanaryGroup, ws: PlanWorkspace, capacity: int, tuning: KernelTuning = DEFAULT_TUNING) -> bool:
    """Whether :func:`plan_verify` is one launch: the workspace admits at most ``fuse_max_batch`` rows and
    the verify launch's grid fits one wave (one program per SM; always under the interpreter).

    Static (capacities only), so a captured graph keeps its launches.  Larger workspaces keep the plan
    launch: the fused kernel holds every row's spans in registers (198 per thread on Triton 3.6, one
    block per SM) and pays block-wide reductions per item, which measured slower beyond small steps
    (benchmarks/README.md, commit 49ac254: decode b32 x 16k 33.9 us fused against 26.4 us in three launches).
    """
    max_b = int(ws.row_state.shape[0])
    verify_items = -(-capacity // verify_block(group, tuning)) + max_b
    return _small_step(ws, max(verify_items, _write_items(ws, tuning)), tuning)


def _write_items(ws: PlanWorkspace, tuning: KernelTuning) -> int:
    """Stamp items of the largest step the workspace admits."""
    return -(-(int(ws.mult_powers.shape[0]) - 1) // tuning.stamp_block) + int(ws.row_state.shape[0])


def _small_step(ws: PlanWorkspace, items: int, tuning: KernelTuning) -> bool:
    """Few rows (one row block, at most fuse_max_batch) and a grid of one wave: kernels may derive the row
    spans from the lengths in registers instead of reading the plan's."""
    max_b = int(ws.row_state.shape[0])
    if max_b > tuning.fuse_max_batch or max_b > _row_block(ws, tuning):
        return False
    dev = ws.sync.device
    return dev.type != "cuda" or items <= torch.cuda.get_device_properties(dev).multi_processor_count


def plan_verify(
    group: CanaryGroup,
    batch: StepBatch,
    records: RecordStore,
    ws: PlanWorkspace,
    log: ViolationLog,
    capacity: int,
    *,
    tuning: KernelTuning = DEFAULT_TUNING,
    checked: bool = False,
) -> None:
    """reference.plan then reference.verify, in one launch where :func:`fuses_plan` (else two): the same
    workspace, records and log as the two calls (the plan's log rows before verify's)."""
    dev = _checked_device(group, batch, records, ws, log, checked)
    _check_capacity(ws, group, capacity, tuning)  # before the plan changes anything
    if not fuses_plan(group, ws, capacity, tuning):
        plan(group, batch, records, ws, log, tuning=tuning, checked=True)
        _launch_verify(group, batch, records, ws, log, capacity, tuning, dev, fused=False)
        return
    _launch_verify(group, batch, records, ws, log, capacity, tuning, dev, fused=True)


def _check_capacity(ws: PlanWorkspace, group: CanaryGroup, capacity: int, tuning: KernelTuning) -> int:
    """Verify items the capacity allows, after checking that the workspace's scratch holds them."""
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
        raise ValueError(f"capacity must be a positive int, got {capacity!r}")
    max_b = int(ws.row_state.shape[0])
    max_items = -(-capacity // verify_block(group, tuning)) + max_b
    if max_items > ws.verify_counts.shape[0]:
        raise ValueError(
            f"capacity {capacity} exceeds the workspace's verify scratch (allocated for "
            f"{(ws.verify_counts.shape[0] - max_b) * PlanWorkspace.SCRATCH_BLOCK} entries)"
        )
    return max_items


def _launch_verify(
    group: CanaryGroup,
    batch: StepBatch,
    records: RecordStore,
    ws: PlanWorkspace,
    log: ViolationLog,
    capacity: int,
    tuning: KernelTuning,
    dev: torch.device,
    *,
    fused: bool,
) -> None:
    max_items = _check_capacity(ws, group, capacity, tuning)
    dummy = ws.sync
    lookup, n_lookup, has_lookup = _lookup(batch, dummy)
    truth, truth_lens, t_rows, t_cols, has_truth = _truth(batch, dummy)
    n_rows, n_cols = (int(s) for s in batch.table.shape)
    # The same programs mark the step's writes: enough of them for the largest prefill chunk too.
    verify_kernel[_grid(max(max_items, _write_items(ws, tuning)), dev, tuning)](
        _ptr(batch.rows, dummy), _ptr(batch.table, dummy), lookup, truth, truth_lens,
        records.tokens, records.positions, records.links,
        ws.verify_offsets, ws.window_starts, ws.verify_items, ws.verify_counts, ws.sync[_VERIFY_SYNC:],
        log.first, log.last, log.counters,
        _ptr(batch.out_cache_loc, dummy), ws.write_offsets, ws.write_items, ws.epoch, ws.read_marks, ws.write_marks,
        ws.write_old_positions, _ptr(batch.prefix_lens, dummy), _ptr(batch.extend_lens, dummy), ws.seed_links,
        ws.row_state,
        batch.batch_size, n_rows, n_cols, n_lookup, t_rows, t_cols, group.num_slots, capacity, max_items,
        log.capacity, group.group_id, group.page_size, group.token_offset, *_reserved(group), batch.num_tokens,
        group.window, n_cols * group.page_size, int(group.padding_row is not None), group.padding_row or 0,
        PAGED=group.page_size > 1, HAS_LOOKUP=has_lookup, HAS_TRUTH=has_truth,
        BLOCK=verify_block(group, tuning), BLOCK_B=_row_block(ws, tuning), STAMP_BLOCK=tuning.stamp_block,
        FUSED=fused, num_warps=tuning.verify_warps,
    )  # fmt: skip


def stamp(
    group: CanaryGroup,
    batch: StepBatch,
    records: RecordStore,
    ws: PlanWorkspace,
    log: ViolationLog,
    *,
    tuning: KernelTuning = DEFAULT_TUNING,
    checked: bool = False,
) -> None:
    """reference.stamp on device: records of the tokens of active rows, chained from the plan's seeds.

    Two tokens of one step that write the same slot are both reported (``duplicate_write``); which record
    survives is unspecified, and here each of the three fields holds one of the writes (they are stored
    separately, so the record may mix them; the next verify reports a mixed record too).
    """
    dev = _checked_device(group, batch, records, ws, log, checked)
    max_b = int(ws.row_state.shape[0])
    max_tokens = int(ws.mult_powers.shape[0]) - 1
    max_items = -(-max_tokens // tuning.stamp_block) + max_b
    if max_items > ws.stamp_counts.shape[0]:
        raise ValueError(f"stamp_block {tuning.stamp_block} needs {max_items} work items; the workspace has fewer")
    dummy = ws.sync
    lookup, n_lookup, has_lookup = _lookup(batch, dummy)
    truth, truth_lens, t_rows, t_cols, has_truth = _truth(batch, dummy)
    n_rows, n_cols = (int(s) for s in batch.table.shape)
    stamp_kernel[_grid(max_items, dev, tuning)](
        _ptr(batch.rows, dummy), _ptr(batch.prefix_lens, dummy), _ptr(batch.input_ids, dummy),
        _ptr(batch.positions, dummy), _ptr(batch.out_cache_loc, dummy), lookup, truth, truth_lens,
        ws.write_offsets, ws.seed_links, ws.write_items, ws.mult_powers, ws.inv_powers,
        records.tokens, records.positions, records.links, ws.stamp_counts, ws.stamp_sums, ws.stamp_flags,
        ws.sync[_STAMP_SYNC:],
        log.first, log.last, log.counters, _ptr(batch.table, dummy), ws.epoch, ws.read_marks, ws.write_marks,
        ws.write_old_positions,
        batch.batch_size, batch.num_tokens, max_tokens + 1, n_lookup, t_rows, t_cols, group.num_slots,
        max_items, log.capacity, group.group_id, group.token_offset, *_reserved(group),
        n_rows, n_cols, group.page_size, group.window, _ptr(batch.extend_lens, dummy), n_cols * group.page_size,
        int(group.padding_row is not None), group.padding_row or 0,
        HAS_LOOKUP=has_lookup, HAS_TRUTH=has_truth, PAGED=group.page_size > 1, CHECK_NEW=group.checks_new_reads,
        ROWS=_small_step(ws, max_items, tuning),
        BLOCK=tuning.stamp_block, BLOCK_B=_row_block(ws, tuning), CARRY_BLOCK=tuning.carry_block,
        POLLS=tuning.stamp_polls if dev.type == "cuda" else tuning.interpreter_polls,
        num_warps=tuning.stamp_warps,
    )  # fmt: skip
