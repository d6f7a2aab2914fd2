"""The manager's per-step host work on the kernel path, pinned: one validation per group, two kernel
launches per group (three past the fused launch's batch limit), a fixed handful of torch ops, nothing read back.

On a GPU every torch op is a launch and every validation a few dozen Python checks; issue 14 measured
``validate_batch`` running five times per group per step (manager, canary, three launchers).  The kernels
are replaced by counting stand-ins here, so the test needs neither a GPU nor the interpreter.
"""

from __future__ import annotations

import collections
import dataclasses

import pytest

from kvcanary import canary as canary_module
from kvcanary.config import CanaryConfig, Mode
from kvcanary.layout import CanaryGroup
from kvcanary.ops import Backend, launchers
from kvcanary.runtime import CanaryManager
from kvcanary.workspace import Capacities
from op_counting import NO_KERNEL, SYNCING, OpCounter
from runtime_helpers import CAPS, NUM_SLOTS, Workload

AFTER_OPS = 4  # snapshot copy, totals add, live clear, phase mark
BEFORE_OPS = 0  # the phase mark is counted inside the first group's first launch


def two_group_manager(backend: Backend, check_values: bool | None = None, caps: Capacities = CAPS) -> CanaryManager:
    """``check_values=False`` is the GPU path's default (values are never read on the host there)."""
    groups = [CanaryGroup(num_slots=NUM_SLOTS, group_id=i, name=n) for i, n in enumerate(("a", "b"))]
    return CanaryManager(groups, caps, CanaryConfig(mode=Mode.LOG, check_values=check_values), backend=backend)


# Up to KernelTuning.fuse_max_batch rows (8 by default) plan and verify share one launch; past it, three.
FUSED = {"validate_batch": 2, "verify_kernel": 2, "stamp_kernel": 2}
UNFUSED = {"validate_batch": 2, "plan_kernel": 2, "verify_kernel": 2, "stamp_kernel": 2}


@pytest.mark.parametrize(
    ("caps", "launches"),
    [(CAPS, FUSED), (dataclasses.replace(CAPS, max_batch=launchers.DEFAULT_TUNING.fuse_max_batch + 1), UNFUSED)],
    ids=["fused", "three-launches"],
)
def test_kernel_path_validates_each_groups_batch_once_and_launches_each_kernel_once(
    counted: collections.Counter[str], caps: Capacities, launches: dict[str, int]
) -> None:
    mgr = two_group_manager(Backend.TRITON, check_values=False, caps=caps)
    wl = Workload()
    for plan in ([(1, 4), (2, 3)], [(1, 1), (2, 1)], [(1, 1), (2, 1), (3, 5)]):
        batch = wl.batch(plan, truth=True)
        counted.clear()
        with OpCounter() as ops:
            mgr.before_forward({"a": batch, "b": batch})
            mgr.after_forward()
        assert counted == launches
        kernels = {op: n for op, n in ops.ops.items() if op not in NO_KERNEL}
        assert sum(kernels.values()) == BEFORE_OPS + AFTER_OPS, kernels
        assert not SYNCING & set(ops.ops), ops.ops
        mgr.host_step(["x"] * batch.batch_size)


def test_the_value_checks_still_run_once_on_cpu_and_raise_before_any_launch(
    counted: collections.Counter[str],
) -> None:
    mgr = two_group_manager(Backend.TRITON)
    batch = Workload().batch([(1, 4)], truth=True)
    assert batch.truth_lens is not None
    batch.truth_lens[0] = 10_000  # the adapter's own claim: API misuse, raised by the one validation
    with pytest.raises(ValueError, match="group 'a': truth_lens exceeds"):
        mgr.before_forward({"a": batch, "b": batch})
    assert counted == {"validate_batch": 1}


def test_the_public_launchers_and_canary_calls_keep_their_own_checks(counted: collections.Counter[str]) -> None:
    group = CanaryGroup(num_slots=NUM_SLOTS, name="a")
    can = canary_module.GroupCanary(group, CAPS, backend=Backend.TRITON)
    log = can.new_log()
    batch = Workload().batch([(1, 4)])
    can.step(batch, log)
    assert counted["validate_batch"] == 1 and counted["check_state"] == 0
    counted.clear()
    can.plan(batch, log)
    can.verify(batch, log)
    can.stamp(batch, log)
    assert counted["validate_batch"] == 3 and counted["check_state"] == 2  # verify and stamp check again
    counted.clear()
    launchers.plan(can.state(log), batch)
    assert counted["validate_batch"] == 1 and counted["check_state"] == 1
    bad = Workload().batch([(1, 4)])
    bad.positions = bad.positions.float()
    with pytest.raises(TypeError, match="positions must be int32 or int64"):
        launchers.verify(can.state(log), bad, CAPS.verify_entries)


def test_reference_path_validates_each_groups_batch_once(counted: collections.Counter[str]) -> None:
    mgr = two_group_manager(Backend.REFERENCE)
    batch = Workload().batch([(1, 4), (2, 3)], truth=True)
    mgr.before_forward({"a": batch, "b": batch})
    mgr.after_forward()
    assert counted == {"validate_batch": 2}
