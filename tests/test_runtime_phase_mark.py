"""The before-forward phase mark counted inside the first group's first launch (no launch of its own).

The fused plan + verify counts it in its last program, the plan kernel in its one program (past the fused
launch's batch limit), the reference path with a torch op: every path counts it once a step, changes nothing
else, and the manager's phase marks stay in step over a run.  Under the interpreter on CPU, compiled on CUDA.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvcanary.canary import GroupCanary
from kvcanary.config import CanaryConfig, Mode
from kvcanary.layout import CanaryGroup
from kvcanary.ops import Backend, launchers
from kvcanary.runtime import CanaryManager
from kvcanary.runtime.buffers import PHASE_AFTER, PHASE_BEFORE
from kvcanary.workspace import Capacities
from runtime_helpers import CAPS, NUM_SLOTS, Workload

pytest.importorskip("triton")

DEV = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

UNFUSED_CAPS = dataclasses.replace(CAPS, max_batch=launchers.DEFAULT_TUNING.fuse_max_batch + 1)
PATHS = [
    pytest.param(Backend.TRITON, CAPS, id="fused-launch"),
    pytest.param(Backend.TRITON, UNFUSED_CAPS, id="plan-launch"),
    pytest.param(Backend.REFERENCE, CAPS, id="reference"),
]
STEPS = ([(1, 4), (2, 3)], [(1, 1), (2, 1)], [(1, 1), (2, 1), (3, 5)])


def _run(backend: Backend, caps: Capacities, mark: torch.Tensor | None) -> tuple[GroupCanary, torch.Tensor]:
    """Three steps of one canary; the state it leaves and the log's counters."""
    canary = GroupCanary(CanaryGroup(num_slots=NUM_SLOTS, name="a"), caps, DEV, backend)
    log = canary.new_log()
    wl = Workload()
    for plan in STEPS:
        canary.step(wl.batch(plan, truth=True).to(DEV), log, mark=mark)
    return canary, log.counters.clone()


@pytest.mark.parametrize(("backend", "caps"), PATHS)
def test_each_step_counts_the_mark_once_and_changes_nothing_else(backend: Backend, caps: Capacities) -> None:
    if backend is Backend.REFERENCE and DEV.type == "cuda":
        pytest.skip("the reference path reads values on the host: a CPU path")
    mark = torch.tensor([40], dtype=torch.int64, device=DEV)
    marked, marked_counters = _run(backend, caps, mark)
    plain, plain_counters = _run(backend, caps, None)
    assert int(mark) == 40 + len(STEPS)
    assert torch.equal(marked_counters, plain_counters)
    for field in ("tokens", "positions", "links"):
        assert torch.equal(getattr(marked.records, field), getattr(plain.records, field))
    assert torch.equal(marked.workspace.epoch, plain.workspace.epoch)


@pytest.mark.parametrize(
    "mark",
    [torch.zeros(1, dtype=torch.int32), torch.zeros(2, dtype=torch.int64), torch.zeros((1, 1), dtype=torch.int64)],
    ids=["int32", "two-elements", "2d"],
)
@pytest.mark.parametrize("caps", [CAPS, UNFUSED_CAPS], ids=["fused-launch", "plan-launch"])
def test_a_malformed_mark_is_refused_before_anything_runs(mark: torch.Tensor, caps: Capacities) -> None:
    canary = GroupCanary(CanaryGroup(num_slots=NUM_SLOTS, name="a"), caps, DEV, Backend.TRITON)
    log = canary.new_log()
    batch = Workload().batch([(1, 4)]).to(DEV)
    mark = mark.to(DEV)
    with pytest.raises((TypeError, ValueError), match="mark"):
        canary.step(batch, log, mark=mark)
    assert int(canary.workspace.epoch) == 0 and not torch.count_nonzero(log.counters)
    assert not torch.count_nonzero(mark)


@pytest.mark.parametrize(("backend", "caps"), PATHS)
def test_the_managers_phase_marks_stay_in_step_with_two_groups(backend: Backend, caps: Capacities) -> None:
    if backend is Backend.REFERENCE and DEV.type == "cuda":
        pytest.skip("the reference path reads values on the host: a CPU path")
    groups = [CanaryGroup(num_slots=NUM_SLOTS, group_id=i, name=n) for i, n in enumerate(("a", "b"))]
    config = CanaryConfig(mode=Mode.RAISE, health_every=1, health_warmup=0)
    mgr = CanaryManager(groups, caps, config, DEV, backend)
    wl = Workload()
    for k, plan in enumerate(STEPS):
        batch = wl.batch(plan, truth=True).to(DEV)
        mgr.before_forward({"a": batch, "b": batch})
        mgr.after_forward()
        phase = mgr._work.layout.phase(mgr._work.outbox)
        assert int(phase[PHASE_BEFORE]) == int(phase[PHASE_AFTER]) == k + 1
        mgr.host_step(["x"] * batch.batch_size)
    mgr.flush()
    assert mgr.stats()["health_failures"] == 0 and mgr.stats()["steps"] == len(STEPS)
