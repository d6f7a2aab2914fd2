"""Health (kernels ran) and phase (graph holds the canary's work) checks, in log and raise modes.

CUDA graphs do not exist on CPU; a replay is emulated by running (or not running) the manager's
device work directly, after telling the manager a graph was captured.
"""

from __future__ import annotations

import logging

import pytest
import torch

from kvcanary import Mode
from kvcanary.runtime import CanaryHealthError, CanaryManager
from runtime_helpers import Workload, emulate_capture, make_manager, replay, run_step


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def _replayed_run(mgr: CanaryManager, steps: int, before: bool, after: bool) -> None:
    wl = Workload()
    run_step(mgr, wl.batch([(1, 4), (2, 4)]), ["a", "b"])  # eager warm-up step
    emulate_capture(mgr)
    for _ in range(steps):
        replay(mgr, wl.batch([(1, 1), (2, 1)]), before, after)
        mgr.host_step(["a", "b"])
    mgr.flush()


def test_replays_with_the_canary_work_pass_the_phase_check(caplog: pytest.LogCaptureFixture) -> None:
    mgr = make_manager(Mode.RAISE, health_every=2)
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        _replayed_run(mgr, 5, before=True, after=True)
    assert not caplog.records
    assert mgr.stats()["forwards"] == 6 and mgr.stats()["health_failures"] == 0


@pytest.mark.parametrize(
    ("before", "after", "match"), [(False, False, "no canary device work"), (True, False, "out of step")]
)
def test_phase_check_logs_in_log_mode(caplog: pytest.LogCaptureFixture, before: bool, after: bool, match: str) -> None:
    mgr = make_manager(Mode.LOG, health_every=0, log_rate_limit_per_s=1e9)
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        _replayed_run(mgr, 3, before=before, after=after)
    errors = _errors(caplog)
    assert errors and all("(phase)" in e and match in e for e in errors)
    assert mgr.stats()["health_failures"] == 3


def test_phase_check_raises_in_raise_mode() -> None:
    mgr = make_manager(Mode.RAISE, health_every=0)
    wl = Workload()
    run_step(mgr, wl.batch([(1, 4)]), ["a"])
    emulate_capture(mgr)
    mgr.host_step(["a"])  # step 1: a replay without the canary's work; step 0 decodes clean
    with pytest.raises(CanaryHealthError, match="phase: no canary device work"):
        mgr.flush()


def _disable_kernels(mgr: CanaryManager) -> None:
    """Emulate kernels that launch but do nothing but the phase mark the first one counts."""

    def step_that_only_marks(*_args: object, mark: torch.Tensor | None = None, **_kwargs: object) -> None:
        if mark is not None:
            mark.add_(1)

    for canary in mgr.canaries.values():
        canary.step = step_that_only_marks  # type: ignore[method-assign]


def test_health_check_logs_in_log_mode_and_serving_continues(caplog: pytest.LogCaptureFixture) -> None:
    mgr = make_manager(Mode.LOG, health_every=2, health_warmup=1, log_rate_limit_per_s=1e9)
    wl = Workload()
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        for k in range(7):
            if k == 2:
                _disable_kernels(mgr)
            run_step(mgr, wl.batch([(1, 4 if k == 0 else 1)]), ["a"])
        mgr.flush()
    errors = _errors(caplog)
    # checks at decoded steps 1 (ran), 3 and 5 (did not run)
    assert len(errors) == 2 and all("(kernels_ran)" in e and "group 'full'" in e for e in errors)
    assert mgr.stats()["health_failures"] == 2 and mgr.stats()["steps"] == 7


def test_health_check_raises_in_raise_mode() -> None:
    mgr = make_manager(Mode.RAISE, health_every=2, health_warmup=1)
    wl = Workload()
    for k in range(4):
        if k == 2:
            _disable_kernels(mgr)
        run_step(mgr, wl.batch([(1, 4 if k == 0 else 1)]), ["a"])
    with pytest.raises(CanaryHealthError, match="kernels_ran: canary kernels did not run for group 'full'"):
        mgr.flush()  # decodes step 3, the second check


def test_health_check_stays_silent_when_kernels_run(caplog: pytest.LogCaptureFixture) -> None:
    mgr = make_manager(Mode.RAISE, health_every=1, health_warmup=0)
    wl = Workload()
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        for k in range(5):
            run_step(mgr, wl.batch([(1, 4 if k == 0 else 1)]), ["a"])
        mgr.flush()
    assert not caplog.records and mgr.stats()["health_failures"] == 0


def test_periodic_stats_line(caplog: pytest.LogCaptureFixture) -> None:
    mgr = make_manager(Mode.LOG, stats_every=2)
    wl = Workload()
    with caplog.at_level(logging.WARNING, logger="kvcanary"):  # visible at Python's default level
        for k in range(4):
            run_step(mgr, wl.batch([(1, 4 if k == 0 else 1)]), ["a"])
        mgr.flush()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kvcanary stats:")]
    tail = "violations=0 skipped_entries=0 health_failures=0"
    assert lines == [
        f"kvcanary stats: step=1 forwards=2 verified_slots=4 stamped=5 {tail}",
        f"kvcanary stats: step=3 forwards=4 verified_slots=15 stamped=7 {tail}",
    ]


def test_partial_verification_is_counted_and_warned_once(caplog: pytest.LogCaptureFixture) -> None:
    from kvcanary import CanaryConfig, CanaryGroup, Capacities

    caps = Capacities(max_batch=8, max_tokens=64, verify_entries=6, max_context=6)
    mgr = CanaryManager([CanaryGroup(num_slots=256, name="full")], caps, CanaryConfig(health_every=1))
    wl = Workload()
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        for k in range(4):
            run_step(mgr, wl.batch([(1, 4 if k == 0 else 1), (2, 4 if k == 0 else 1)]), ["a", "b"])
        mgr.flush()
    # verify spans per step: 0, 8, 10, 12 entries against a capacity of 6
    assert mgr.stats()["verified_slots"] == 18 and mgr.stats()["skipped_entries"] == 2 + 4 + 6
    warnings = [r.getMessage() for r in caplog.records if "verification was partial" in r.getMessage()]
    assert len(warnings) == 1


def test_phase_check_on_its_public_api() -> None:
    """The rule itself, without a manager: both marks advance by the same amount between host steps."""
    from kvcanary.runtime.checks import PhaseCheck

    check = PhaseCheck()
    assert check.advance(1, 1) is None  # one eager forward
    assert check.advance(4, 4) is None  # three forwards (warm-ups) before one host step
    missing = check.advance(4, 4)  # a replay that ran none of the canary's work
    assert missing is not None and "no canary device work" in missing
    half = check.advance(5, 4)  # a graph holding before_forward's work but not after_forward's
    assert half is not None and "out of step" in half and "before_forward ran 1" in half
    assert check.advance(6, 5) is None  # each step is judged by its own deltas: +1 and +1
