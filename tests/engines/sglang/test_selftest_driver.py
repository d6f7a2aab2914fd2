"""The sglang self-test driver on the engine-neutral runner: every fault caught, controls silent.

CI runs the full matrix (``kvcanary selftest --engine sglang --trials 5`` in scripts/ci-sglang.sh); this
test runs one trial per fault on the session's scheduler and checks what the matrix cannot show: the
injections are the ones documented and a clean run offers every fault an eligible step.
"""

from __future__ import annotations

from kvcanary.adapters.sglang.selftest import FAULTS, SglangDriver
from kvcanary.adapters.sglang.selftest.driver import run_once
from kvcanary.adapters.sglang.selftest.faults import WORKLOAD
from kvcanary.adapters.sglang.selftest.workload import standard_workload
from kvcanary.selftest.protocol import RunSpec
from kvcanary.selftest.runner import run_selftest


def _driver(loop) -> SglangDriver:
    driver = SglangDriver()
    driver.loop = loop  # sglang builds its process groups once per process: share the session's scheduler
    return driver


def test_every_fault_is_caught_within_one_step_and_the_controls_are_silent(loop) -> None:
    result = run_selftest(_driver(loop), trials=1, seed=7)
    assert result.false_positives == 0 and result.control_errors == 0
    for row in result.rows:
        assert len(row.trials) == 1, row.spec.name
        trial = row.trials[0]
        assert trial.outcome == "caught" and trial.expected_check and trial.attributed, trial
        assert trial.steps is None or trial.steps <= 1, trial
    assert result.passed


def test_a_clean_control_offers_every_fault_a_step_and_changes_nothing(loop) -> None:
    faults = [cls() for cls in FAULTS.values()]
    control = run_once(loop, standard_workload(2), RunSpec(WORKLOAD, 2, faults))
    assert not control.errors and control.violations == 0 and control.injection is None
    assert set(control.opportunities) == set(FAULTS), control.opportunities
    assert control.store  # the oracle recorded its clean reference
    plain = run_once(loop, standard_workload(2), RunSpec(WORKLOAD, 2, []))
    assert plain.stats == control.stats  # probing hooks do not perturb sglang
