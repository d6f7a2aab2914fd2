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

import os

import torch

from kvcanary.batch import StepBatch, validate_batch
from kvcanary.layout import CanaryGroup
from kvcanary.ops.kernel_tuning import (  # KernelTuning, DEFAULT_TUNING, fuses_plan: also public here
    DEFAULT_TUNING,
    KernelTuning,
    fuses_plan,
    grid,
    row_block,
    small_step,
    verify_block,
    write_items,
)
from kvcanary.ops.kernels.plan import plan_kernel
from kvcanary.ops.kernels.stamp import stamp_kernel
from kvcanary.ops.kernels.verify import verify_kernel
from kvcanary.schema import NUM_COUNTERS, ROW_WIDTH
from kvcanary.workspace import GroupState, PlanWorkspace

_SYNC_WORDS = 4  # per phase: the sync scratch words of one kernel (see kernels/log.py)
_VERIFY_SYNC = 0
_STAMP_SYNC = _SYNC_WORDS
# Sync words that are 0 whenever no call runs: pending and ticket of each phase, verify's plan pending.
SYNC_CLEAR = [0, 1, 3, 4, 5]


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


def _check_state(state: GroupState) -> torch.device:
    """The canary's own state: records, workspace and log on one device with consistent shapes."""
    if not isinstance(state, GroupState):
        raise TypeError(f"state must be a kvcanary.workspace.GroupState, got {type(state).__name__}")
    group, records, ws, log = state
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


def _checked_device(state: GroupState, batch: StepBatch, checked: bool) -> torch.device:
    """The device of the canary's state, after the host checks (``checked``: the caller -- a
    :class:`~kvcanary.canary.GroupCanary`, which allocated the state -- validated this batch this step)."""
    if not checked:
        dev = _check_state(state)
        _check_batch(state.group, batch, state.ws, dev)
        return dev
    dev = state.records.links.device
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


def _phase_mark(mark: torch.Tensor | None, dummy: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A phase-mark counter for the launch to bump (int64, one element, on the state's device), or none."""
    if mark is None:
        return dummy, False
    _check_tensor("mark", mark, torch.int64, (1,), dummy.device)
    return mark, True


def _reserved(group: CanaryGroup) -> list[int]:
    return list(group.reserved_slots) + [-1] * (CanaryGroup.MAX_RESERVED - len(group.reserved_slots))


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
    state: GroupState,
    batch: StepBatch,
    *,
    tuning: KernelTuning = DEFAULT_TUNING,
    checked: bool = False,
    mark: torch.Tensor | None = None,
) -> None:
    """reference.plan on device (one program; the batch is small next to its verify work).  ``mark``: a
    counter (int64, one element) the launch also adds 1 to: the runtime's before-forward phase mark."""
    _checked_device(state, batch, checked)
    group, records, ws, log = state
    dummy = ws.sync
    mark_ptr, has_mark = _phase_mark(mark, dummy)
    lookup, n_lookup, has_lookup = _lookup(batch, dummy)
    n_rows, n_cols = (int(s) for s in batch.table.shape)
    plan_kernel[(1,)](
        _ptr(batch.rows, dummy), _ptr(batch.prefix_lens, dummy), _ptr(batch.extend_lens, dummy),
        _ptr(batch.table, dummy), lookup, records.links,
        ws.write_offsets, ws.verify_offsets, ws.window_starts, ws.seed_links, ws.row_state,
        ws.verify_items, ws.write_items, ws.epoch, log.first, log.last, log.counters, mark_ptr,
        batch.batch_size, n_rows, n_cols, n_cols * group.page_size, n_lookup, group.num_slots, batch.num_tokens,
        group.window, int(group.padding_row is not None), group.padding_row or 0, group.page_size, log.capacity,
        group.group_id, *_reserved(group),
        PAGED=group.page_size > 1, HAS_LOOKUP=has_lookup, HAS_PHASE_MARK=has_mark,
        VERIFY_BLOCK=verify_block(group, tuning), STAMP_BLOCK=tuning.stamp_block,
        BLOCK_B=row_block(ws, tuning), num_warps=4,
    )  # fmt: skip


def verify(
    state: GroupState, batch: StepBatch, capacity: int, *, tuning: KernelTuning = DEFAULT_TUNING, checked: bool = False
) -> None:
    """reference.verify on device: entries of the last plan, up to ``capacity`` (the rest counted skipped)."""
    dev = _checked_device(state, batch, checked)
    _launch_verify(state, batch, capacity, tuning, dev, fused=False)


def plan_verify(
    state: GroupState,
    batch: StepBatch,
    capacity: int,
    *,
    tuning: KernelTuning = DEFAULT_TUNING,
    checked: bool = False,
    mark: torch.Tensor | None = None,
) -> None:
    """reference.plan then reference.verify, in one launch where :func:`fuses_plan` (else two): the same
    workspace, records and log as the two calls (the plan's log rows before verify's).  ``mark``: as
    :func:`plan`'s, added to by the first launch."""
    dev = _checked_device(state, batch, checked)
    _check_capacity(state.ws, state.group, capacity, tuning)  # before the plan changes anything
    _phase_mark(mark, state.ws.sync)
    if not fuses_plan(state.group, state.ws, capacity, tuning):
        plan(state, batch, tuning=tuning, checked=True, mark=mark)
        _launch_verify(state, batch, capacity, tuning, dev, fused=False)
        return
    _launch_verify(state, batch, capacity, tuning, dev, fused=True, mark=mark)


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
    state: GroupState,
    batch: StepBatch,
    capacity: int,
    tuning: KernelTuning,
    dev: torch.device,
    *,
    fused: bool,
    mark: torch.Tensor | None = None,
) -> None:
    group, records, ws, log = state
    max_items = _check_capacity(ws, group, capacity, tuning)
    dummy = ws.sync
    mark_ptr, has_mark = _phase_mark(mark, dummy)
    lookup, n_lookup, has_lookup = _lookup(batch, dummy)
    truth, truth_lens, t_rows, t_cols, has_truth = _truth(batch, dummy)
    n_rows, n_cols = (int(s) for s in batch.table.shape)
    # The same programs mark the step's writes: enough of them for the largest prefill chunk too.
    verify_kernel[grid(max(max_items, write_items(ws, tuning)), dev, tuning)](
        _ptr(batch.rows, dummy), _ptr(batch.table, dummy), lookup, truth, truth_lens,
        records.tokens, records.positions, records.links,
        ws.verify_offsets, ws.window_starts, ws.verify_items, ws.verify_counts, ws.sync[_VERIFY_SYNC:],
        log.first, log.last, log.counters,
        _ptr(batch.out_cache_loc, dummy), ws.write_offsets, ws.write_items, ws.epoch, ws.read_marks, ws.write_marks,
        ws.write_old_positions, _ptr(batch.prefix_lens, dummy), _ptr(batch.extend_lens, dummy), ws.seed_links,
        ws.row_state, mark_ptr,
        batch.batch_size, n_rows, n_cols, n_lookup, t_rows, t_cols, group.num_slots, capacity, max_items,
        log.capacity, group.group_id, group.page_size, group.token_offset, *_reserved(group), batch.num_tokens,
        group.window, n_cols * group.page_size, int(group.padding_row is not None), group.padding_row or 0,
        PAGED=group.page_size > 1, HAS_LOOKUP=has_lookup, HAS_TRUTH=has_truth,
        BLOCK=verify_block(group, tuning), BLOCK_B=row_block(ws, tuning), STAMP_BLOCK=tuning.stamp_block,
        FUSED=fused, HAS_PHASE_MARK=has_mark, num_warps=tuning.verify_warps, maxnreg=tuning.verify_maxnreg or None,
    )  # fmt: skip


def stamp(state: GroupState, batch: StepBatch, *, tuning: KernelTuning = DEFAULT_TUNING, checked: bool = False) -> None:
    """reference.stamp on device: records of the tokens of active rows, chained from the plan's seeds.

    Two tokens of one step that write the same slot are both reported (``duplicate_write``); which record
    survives is unspecified, and here each of the three fields holds one of the writes (they are stored
    separately, so the record may mix them; the next verify reports a mixed record too).
    """
    dev = _checked_device(state, batch, checked)
    group, records, ws, log = state
    max_b = int(ws.row_state.shape[0])
    max_tokens = int(ws.mult_powers.shape[0]) - 1
    max_items = -(-max_tokens // tuning.stamp_block) + max_b
    if max_items > ws.stamp_counts.shape[0]:
        raise ValueError(f"stamp_block {tuning.stamp_block} needs {max_items} work items; the workspace has fewer")
    dummy = ws.sync
    lookup, n_lookup, has_lookup = _lookup(batch, dummy)
    truth, truth_lens, t_rows, t_cols, has_truth = _truth(batch, dummy)
    n_rows, n_cols = (int(s) for s in batch.table.shape)
    stamp_kernel[grid(max_items, dev, tuning)](
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
        ROWS=small_step(ws, max_items, tuning),
        BLOCK=tuning.stamp_block, BLOCK_B=row_block(ws, tuning), CARRY_BLOCK=tuning.carry_block,
        POLLS=tuning.stamp_polls if dev.type == "cuda" else tuning.interpreter_polls,
        num_warps=tuning.stamp_warps,
    )  # fmt: skip
