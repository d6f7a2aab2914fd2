"""CPU offload and restore on the real engine: the records follow the bytes through the host pool.

A restore that reads the wrong host block into the right device blocks (the engine's request -> host
block map rotated) must be caught at or before the first read of the misplaced pages; the clean control
of the same workload stays silent.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch

from kvcanary.adapters.transformers_cb.selftest import FAULTS
from kvcanary.adapters.transformers_cb.selftest.driver import run_engine
from kvcanary.adapters.transformers_cb.selftest.workload import build_model
from kvcanary.selftest.protocol import InjectMode, RunSpec
from kvcanary.selftest.runner import judge

FAULT = "offload-restore-wrong-host-block"


@pytest.fixture(scope="module")
def dense_model() -> torch.nn.Module:
    model: torch.nn.Module = build_model("dense", seed=0)
    return model


@pytest.mark.parametrize("seed", [3, 11])
def test_a_restore_from_the_wrong_host_block_is_caught_at_its_first_read(
    dense_model: torch.nn.Module, seed: int
) -> None:
    fault = FAULTS[FAULT]
    control = run_engine(dense_model, RunSpec("dense", seed, [fault()]))
    assert control.violations == 0 and control.errors == []
    chances = control.opportunities[FAULT]
    assert chances, "the workload never restored a request of two or more blocks"
    target = chances[len(chances) // 2]
    out = run_engine(
        dense_model, RunSpec("dense", seed, [fault()], InjectMode.INJECT, target=(FAULT, target), store=control.store)
    )
    trial = judge(fault.spec, seed, target, out)
    assert trial.injection is not None and trial.affected is not None, trial
    assert trial.outcome == "caught" and trial.steps is not None and trial.steps <= 0, trial
    assert trial.expected_check and trial.attributed and trial.false_reports == 0, trial
