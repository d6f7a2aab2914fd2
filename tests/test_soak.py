"""``kvcanary soak``: the verdict's bounds (each can fail), usage refusals, and a short run on the real engine."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvcanary import cli
from kvcanary.cli_checks import EXIT_USAGE
from kvcanary.soak import RSS_SLACK_BYTES, PhaseProgress, PhaseResult, SoakOptions

MIB = 1 << 20
STEADY = PhaseResult(
    model="dense", steps=1000, requests=200, cancelled=10,
    stats={"violations": 0, "health_failures": 0, "adapter_errors": 0, "hook_misses": 0, "verified_slots": 9},
    features={}, rss_start=400 * MIB, rss_end=401 * MIB, device_start=None, device_end=None,
    step_us_start=2000.0, step_us_end=2100.0, share_start=0.3, share_end=0.31, seconds=1.0,
)  # fmt: skip


def test_a_steady_silent_phase_passes() -> None:
    assert STEADY.failures() == []


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"stats": {**STEADY.stats, "violations": 1}}, "1 violations"),
        ({"stats": {**STEADY.stats, "health_failures": 2}}, "2 health failures"),
        ({"stats": {**STEADY.stats, "adapter_errors": 1}}, "1 adapter errors"),
        ({"rss_end": int(400 * MIB * 1.02) + RSS_SLACK_BYTES + 1}, "RSS grew"),
        ({"step_us_end": 3100.0, "share_end": 0.46}, "step time grew"),
        ({"engine_error": "the generation thread stopped"}, "the engine stopped"),
    ],
)
def test_each_bound_can_fail(change: dict[str, object], expected: str) -> None:
    failures = dataclasses.replace(STEADY, **change).failures()  # type: ignore[arg-type]
    assert len(failures) == 1 and expected in failures[0]


@pytest.mark.parametrize(("steps", "warm_up"), [(20, 10), (300, 150), (1000, 200), (5000, 500), (100_000, 10_000)])
def test_warm_up_is_a_share_of_the_phase_with_a_floor(steps: int, warm_up: int) -> None:
    # A 300-step vLLM phase measured its RSS after 30 steps, before the engine's pools had filled, and failed.
    assert PhaseProgress.for_phase("dense", steps, SoakOptions(), None).clock.warm_up == warm_up


def test_slower_steps_under_outside_load_pass() -> None:
    # Wall time tripled but the canary's share of the step did not move: other processes slowed both.
    assert dataclasses.replace(STEADY, step_us_end=6000.0, share_end=0.3).failures() == []


@pytest.mark.parametrize(
    "argv",
    [["--steps", "3"], ["--device", "tpu"], ["--engine", "no-such-engine"], ["--bogus"], ["--models", "dense,moe"],
     ["--models", "dense,dense"], ["--models", ""]],
)  # fmt: skip
def test_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    try:
        rc = cli.main(["soak", "--quiet", *argv])
    except SystemExit as exc:  # argparse's own refusals
        rc = int(exc.code or 0)
    assert rc == EXIT_USAGE and "soak" in capsys.readouterr().err


def test_help_lists_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["soak", "--help"])
    out = capsys.readouterr().out
    assert "exit codes:" in out and "  3  " in out and "RSS" in out


def test_short_soak_on_the_real_engine_is_silent(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    rc = cli.main(["soak", "--engine", "transformers", "--steps", "120", "--json", "--quiet"])
    result = json.loads(capsys.readouterr().out)
    assert rc == 0 and result["passed"], result["failures"]
    assert result["steps"] >= 120 and result["violations"] == 0 and result["verified_slots"] > 0
    dense, hybrid = result["phases"]
    assert dense["features"]["forks"] > 0 and dense["features"]["prefix_hits"] > 0
    assert hybrid["features"]["ring_wraps"] > 0 and dense["rss_start"] > 0
