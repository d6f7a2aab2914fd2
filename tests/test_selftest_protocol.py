"""The engine-neutral self-test contract without an engine: probe/inject bookkeeping, the oracle's stop rule,
its reference check, and the engine registry."""

from __future__ import annotations

import random

import pytest

from kvcanary.selftest import ENGINES, load_driver
from kvcanary.selftest.protocol import AffectedRead, EngineUnavailable, InjectMode, Injector
from kvcanary.selftest.read_oracle import GRACE_STEPS, ReadOracle


class _Clock(Injector):
    """An injector whose step is set by the test."""

    now = 0

    @property
    def step(self) -> int:
        return self.now


def test_probe_records_each_step_once_and_never_injects() -> None:
    ctx = _Clock(InjectMode.PROBE, rng=random.Random(0))
    for ctx.now in (3, 3, 4, 7):
        assert ctx.take("f") is False
    assert ctx.opportunities == {"f": [3, 4, 7]} and ctx.injection is None


def test_inject_fires_once_for_its_fault_at_or_after_its_step() -> None:
    ctx = _Clock(InjectMode.INJECT, rng=random.Random(0), target=("f", 5))
    ctx.now = 4
    assert not ctx.take("f")
    ctx.now = 6
    assert not ctx.take("g") and ctx.take("f")
    ctx.injected("corrupted", ["r1"])
    assert not ctx.take("f") and ctx.injection is not None and ctx.injection.step == 6
    assert ctx.injection.requests == ("r1",)
    with pytest.raises(ValueError, match="target"):
        _Clock(InjectMode.INJECT, rng=random.Random(0))


def test_a_faults_own_error_is_recorded_not_raised_into_the_engine() -> None:
    ctx = _Clock(InjectMode.PROBE, rng=random.Random(0))
    assert ctx.guard(lambda: 1 // 0)() is None
    assert len(ctx.errors) == 1 and isinstance(ctx.errors[0], ZeroDivisionError)


def test_the_oracle_settles_a_run_by_the_runners_rules() -> None:
    oracle = ReadOracle({}, num_layers=1)
    assert not oracle.settled(done=50, detected=None)  # nothing known yet
    assert not oracle.settled(done=10, detected=10) and oracle.settled(done=10 + GRACE_STEPS, detected=10)
    oracle.first = AffectedRead(step=12, requests=("r",), layer=0, entries=1, diverged=False)
    assert oracle.settled(done=12, detected=12)  # both known: the verdict is fixed
    oracle.later_reads = [13, 15]
    assert not oracle.settled(done=20, detected=None)  # only two later reads of the affected request
    oracle.later_reads.append(17)
    assert oracle.settled(done=20, detected=None) and not oracle.settled(done=17, detected=None)


def test_the_oracle_refuses_a_reference_it_did_not_record() -> None:
    with pytest.raises(TypeError, match="reference a probe run returned"):
        ReadOracle(["not", "a", "store"], num_layers=1)
    assert ReadOracle(None, num_layers=1).recording and not ReadOracle({}, num_layers=1).recording


def test_every_registered_engine_loads_or_says_why_not() -> None:
    assert "transformers" in ENGINES
    for engine in ENGINES:
        try:
            driver = load_driver(engine)
        except EngineUnavailable as exc:
            assert engine in str(exc) or ENGINES[engine] in str(exc)
            continue
        assert driver.name and driver.faults and driver.workloads
        assert {cls.spec.model for cls in driver.faults.values()} <= set(driver.workloads)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_each_engine_spec_file_names_its_fault_classes_in_matrix_order(engine: str) -> None:
    """The fault modules import without their engine: their faults.toml must match the classes one to one."""
    import importlib

    from kvcanary.selftest.specs import load_specs

    package = f"kvcanary.adapters.{engine}.selftest"
    faults = importlib.import_module(f"{package}.faults").FAULTS
    specs, classes = load_specs(package)
    assert list(specs) == list(faults) == list(classes)
    for name, cls in faults.items():
        assert cls.spec == specs[name] and classes[name] == f"faults.{cls.__name__}"
