"""One group's canary: its records, its static workspace and the per-step plan/verify/stamp calls."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcanary.arguments import require_affordable
from kvcanary.batch import StepBatch, validate_batch
from kvcanary.layout import CanaryGroup, RecordRows, RecordStore
from kvcanary.ops import Backend
from kvcanary.ops import reference as ref
from kvcanary.workspace import Capacities, GroupState, PlanWorkspace, ViolationLog


def resolve_device(device: torch.device | str) -> torch.device:
    """``cuda`` -> ``cuda:<current>``: tensors report an indexed device, and batches are compared with it."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!s}: torch sees no CUDA device here (use device='cpu')")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def uses_kernels(backend: Backend, device: torch.device) -> bool:
    """The one backend dispatch: Triton kernels when forced or for CUDA tensors under AUTO, else the
    reference (which reads values on the host and so cannot be captured in a CUDA graph)."""
    if backend is Backend.REFERENCE:
        return False
    return backend is Backend.TRITON or device.type == "cuda"


def shared_records(groups: Sequence[CanaryGroup], device: torch.device) -> dict[str, RecordStore]:
    """By group name, the records of groups that share their slot count with another, allocated as the rows of one
    :class:`~kvcanary.layout.RecordRows` per slot count (a block move landing in all of them alike is then mirrored
    with one gather and one write a tensor); a group whose slot count no other has is left out (it allocates its
    own)."""
    by_slots: dict[int, list[str]] = {}
    for g in groups:
        by_slots.setdefault(g.num_slots, []).append(g.name)
    out: dict[str, RecordStore] = {}
    for slots, names in by_slots.items():
        if len(names) > 1:
            nbytes = len(names) * slots * RecordStore.BYTES_PER_SLOT
            require_affordable(f"the records of groups {names}", nbytes, device, num_slots=slots, groups=len(names))
            out.update(zip(names, RecordRows.allocate(slots, len(names), device).stores(), strict=True))
    return out


class GroupCanary:
    """Records and workspaces for one KV index space, allocated once from declared capacities.

    Each step: :meth:`plan`, then :meth:`verify` (before attention reads), then :meth:`stamp` (the
    slots written this step).  :meth:`plan` validates the batch and raises before any state changes
    (``check_values``, default on for CPU tensors, also checks its values); :meth:`verify` and
    :meth:`stamp` refuse a batch whose shapes differ from the one last planned.
    """

    def __init__(
        self,
        group: CanaryGroup,
        caps: Capacities,
        device: torch.device | str = "cpu",
        backend: Backend = Backend.AUTO,
        records: RecordStore | None = None,
    ) -> None:
        """``records``: the group's store, allocated by the caller (rows of a :class:`~kvcanary.layout.RecordRows`
        shared with other groups; checked as affordable by the caller), else allocated here."""
        caps.check_covers(group.window)
        self.group = group
        self.caps = caps
        self.device = resolve_device(device)
        self.backend = backend
        if records is not None and (records.num_slots != group.num_slots or records.device != self.device):
            raise ValueError(f"group {group.name!r}: its records must be {group.num_slots} slots on {self.device}")
        per_slot = PlanWorkspace.MARK_BYTES_PER_SLOT + (RecordStore.BYTES_PER_SLOT if records is None else 0)
        require_affordable(
            f"group {group.name!r}", group.num_slots * per_slot, self.device, num_slots=group.num_slots,
            bytes_per_slot=per_slot,
        )  # fmt: skip
        self.records = RecordStore.allocate(group.num_slots, self.device) if records is None else records
        self.workspace = PlanWorkspace.allocate(caps, self.device, num_slots=group.num_slots)
        self._planned: tuple[int, int] | None = None

    def new_log(self) -> ViolationLog:
        return ViolationLog.allocate(self.caps.log_rows, self.device)

    def state(self, log: ViolationLog) -> GroupState:
        """This group's state for an operation whose violations go to ``log``."""
        return GroupState(self.group, self.records, self.workspace, log)

    def validate(self, batch: StepBatch, check_values: bool | None = None, *, engine_values: bool = True) -> None:
        """``engine_values=False``: leave lengths and rows to the plan, which reports them as violations."""
        if check_values is None:
            check_values = self.device.type == "cpu"
        validate_batch(
            batch,
            self.group,
            device=self.device,
            max_batch=self.caps.max_batch,
            max_tokens=self.caps.max_tokens,
            check_values=check_values,
            engine_values=engine_values,
        )

    def _require_planned(self, batch: StepBatch, what: str) -> None:
        # The workspace describes the planned batch only; another batch would index it out of shape.
        if self._planned is None:
            raise ValueError(f"{what} called before plan: plan the batch first")
        if _shape_key(batch) != self._planned:
            raise ValueError(f"{what} got a batch shaped unlike the one last planned; plan it first")

    @property
    def uses_kernels(self) -> bool:
        return uses_kernels(self.backend, self.device)

    def plan(
        self, batch: StepBatch, log: ViolationLog, *, check_values: bool | None = None, validated: bool = False
    ) -> None:
        """``validated``: the caller ran :meth:`validate` on this batch this step (the checks are not repeated)."""
        self._planned = None
        if not validated:
            self.validate(batch, check_values)
        self._planned = _shape_key(batch)
        if self.uses_kernels:
            from kvcanary.ops import launchers

            launchers.plan(self.state(log), batch, checked=True)
        else:
            ref.plan(self.state(log), batch)

    def verify(self, batch: StepBatch, log: ViolationLog) -> None:
        """Check the entries of the last :meth:`plan` (same batch)."""
        self._verify(batch, log, same_batch=False)

    def _verify(self, batch: StepBatch, log: ViolationLog, *, same_batch: bool) -> None:
        # same_batch: the very batch plan validated, so the launcher need not check it again.
        self._require_planned(batch, "verify")
        if self.uses_kernels:
            from kvcanary.ops import launchers

            launchers.verify(self.state(log), batch, self.caps.verify_entries, checked=same_batch)
        else:
            ref.verify(self.state(log), batch, self.caps.verify_entries)

    def stamp(self, batch: StepBatch, log: ViolationLog) -> None:
        """Stamp the tokens written this step (same batch as the last :meth:`plan`)."""
        self._stamp(batch, log, same_batch=False)

    def _stamp(self, batch: StepBatch, log: ViolationLog, *, same_batch: bool) -> None:
        self._require_planned(batch, "stamp")
        if self.uses_kernels:
            from kvcanary.ops import launchers

            launchers.stamp(self.state(log), batch, checked=same_batch)
        else:
            ref.stamp(self.state(log), batch)

    def step(
        self,
        batch: StepBatch,
        log: ViolationLog,
        *,
        check_values: bool | None = None,
        validated: bool = False,
        mark: torch.Tensor | None = None,
    ) -> None:
        """plan, verify and stamp in one call; the batch is validated once (not at all when ``validated``).
        On the kernels plan and verify share one launch for small batches
        (:func:`~kvcanary.ops.launchers.plan_verify`, :func:`~kvcanary.ops.kernel_tuning.fuses_plan`).
        ``mark``: a counter (int64, one element, on this device) the step adds 1 to, inside its first launch
        on the kernels: the runtime's before-forward phase mark, without a launch of its own."""
        if not self.uses_kernels:
            self.plan(batch, log, check_values=check_values, validated=validated)
            if mark is not None:
                mark.add_(1)
            self._verify(batch, log, same_batch=True)
            self._stamp(batch, log, same_batch=True)
            return
        from kvcanary.ops import launchers

        self._planned = None
        if not validated:
            self.validate(batch, check_values)
        self._planned = _shape_key(batch)
        state = self.state(log)
        launchers.plan_verify(state, batch, self.caps.verify_entries, checked=True, mark=mark)
        launchers.stamp(state, batch, checked=True)


def _shape_key(batch: StepBatch) -> tuple[int, int]:
    # The workspace is laid out by batch rows and tokens; every other index is bounds-checked anyway.
    return (batch.batch_size, batch.num_tokens)
