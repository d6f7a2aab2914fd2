"""The fault library on the real transformers engine: a small detection matrix (every fault, two trials),
the oracle's two sides (silent on a clean rerun, loud where the canary is blinded), and the catalogue."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from kvcanary.adapters.transformers_cb.selftest import FAULTS, TransformersDriver
from kvcanary.adapters.transformers_cb.selftest.driver import WORKLOAD_KINDS, run_engine
from kvcanary.adapters.transformers_cb.selftest.workload import build_model
from kvcanary.schema import Reason
from kvcanary.selftest import Expect, run_selftest
from kvcanary.selftest.protocol import InjectMode, RunSpec
from kvcanary.selftest.runner import SelftestResult, Trial, judge

REASONS = {str(r.name).lower() for r in Reason}
PHASES = {"plan", "verify", "stamp", "digest_stamp", "digest_verify"}


def test_catalogue_documents_every_fault() -> None:
    assert len(FAULTS) >= 12
    for name, cls in FAULTS.items():
        s = cls.spec
        assert s.name == name and s.model in WORKLOAD_KINDS
        assert s.bug_class and s.mechanism and "#" in s.catalogue  # an example issue from the catalogue
        if s.expected is Expect.DETECT:
            assert s.check != "none" and s.checks and not s.why_miss
            assert all(phase in PHASES and reason in REASONS for phase, reason in s.checks)
        else:
            assert s.check == "none" and not s.checks and s.why_miss


def test_the_spec_file_names_each_fault_class_in_matrix_order() -> None:
    from kvcanary.adapters.transformers_cb.selftest.specs import CLASSES, SPECS

    assert list(SPECS) == list(FAULTS) == list(CLASSES)
    for name, cls in FAULTS.items():
        assert cls.spec is SPECS[name] and CLASSES[name] == f"{cls.__module__.rsplit('.', 1)[1]}.{cls.__name__}"


@pytest.fixture(scope="module")
def matrix() -> SelftestResult:
    return run_selftest(TransformersDriver(), trials=2, seed=7)


def test_small_matrix_detects_every_detect_fault_and_controls_are_silent(matrix: SelftestResult) -> None:
    assert matrix.engine == "transformers" and [r.spec.name for r in matrix.rows] == list(FAULTS)
    assert matrix.false_positives == 0 and matrix.control_errors == 0
    assert len(matrix.controls) >= 2 * len(WORKLOAD_KINDS)
    for row in matrix.rows:
        assert len(row.trials) == 2, row.spec.name
        for t in row.trials:
            assert t.errors == () and t.injection is not None and t.false_reports == 0, (row.spec.name, t)
            if row.spec.expected is Expect.DETECT:
                assert t.outcome == "caught" and t.steps is not None and t.steps <= 1, (row.spec.name, t)
                assert t.expected_check and t.attributed, (row.spec.name, t.first_check)
            else:
                # A real corruption that attention read (the oracle saw it) and the canary did not report.
                assert t.outcome == "missed" and t.affected is not None, (row.spec.name, t)
    assert matrix.passed


def test_faulted_runs_start_from_an_eligible_step_of_their_control(matrix: SelftestResult) -> None:
    for row in matrix.rows:
        for t in row.trials:
            assert t.injection is not None and t.injection.step == t.target_step, (row.spec.name, t)


@pytest.fixture(scope="module")
def dense_model() -> torch.nn.Module:
    model: torch.nn.Module = build_model("dense", seed=0)
    return model


def test_oracle_is_silent_on_a_clean_rerun(dense_model: torch.nn.Module) -> None:
    control = run_engine(dense_model, RunSpec("dense", 3, []))
    assert control.violations == 0 and control.errors == [] and control.store
    rerun = run_engine(
        dense_model, RunSpec("dense", 3, [], InjectMode.INJECT, target=("none", 0), store=control.store), check_from=0
    )
    assert rerun.affected is None and rerun.violations == 0 and rerun.errors == []


def test_a_blinded_canary_misses_what_the_oracle_sees(
    dense_model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvcanary.ops import reference

    fault = FAULTS["use-after-free"]
    control = run_engine(dense_model, RunSpec("dense", 5, [fault()]))
    target = control.opportunities[fault.spec.name][len(control.opportunities[fault.spec.name]) // 3]

    def run() -> Trial:
        out = run_engine(
            dense_model,
            RunSpec("dense", 5, [fault()], InjectMode.INJECT, target=(fault.spec.name, target), store=control.store),
        )
        return judge(fault.spec, 5, target, out)

    seen = run()
    assert seen.outcome == "caught" and seen.affected is not None
    monkeypatch.setattr(reference, "verify", lambda *args, **kwargs: None)  # the canary stops checking reads
    blind = run()
    assert blind.outcome == "missed" and blind.affected is not None
    assert blind.affected.step == seen.affected.step  # the same corruption, read at the same step
