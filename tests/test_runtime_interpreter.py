"""The manager on the kernel path (Triton interpreter on CPU) reports exactly what the reference path does.

The kernels append into log views inside the manager's flat buffers; this checks they and the
snapshot/clear/pump pipeline agree with the reference row for row.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvcanary import Backend, CanaryConfig, CanaryGroup, Mode
from kvcanary.runtime import CanaryManager, StepReport
from runtime_helpers import CAPS, NUM_SLOTS, Workload, alias_first_slot

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(
        torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
        reason="interpreter run: CPU only, TRITON_INTERPRET=1",
    ),
]


def _run(backend: Backend) -> tuple[list[StepReport | None], dict[str, int]]:
    mgr = CanaryManager(
        [CanaryGroup(num_slots=NUM_SLOTS, name="full")], CAPS, CanaryConfig(mode=Mode.LOG), backend=backend
    )
    wl = Workload()
    reports = []
    for k in range(4):
        if k == 2:
            alias_first_slot(wl, victim=2, owner=1)
        mgr.before_forward({"full": wl.batch([(1, 3 if k == 0 else 1), (2, 3 if k == 0 else 1)], truth=True)})
        mgr.after_forward()
        reports.append(mgr.host_step(["a", "b"]))
    reports.append(mgr.flush())
    return reports, mgr.stats()


def test_kernel_path_matches_the_reference_through_the_manager() -> None:
    pytest.importorskip("kvcanary.ops.launchers")
    ref_reports, ref_stats = _run(Backend.REFERENCE)
    ker_reports, ker_stats = _run(Backend.TRITON)
    assert [r is not None for r in ref_reports] == [False, False, False, True, True]
    assert ker_reports == ref_reports
    assert ker_stats == ref_stats
