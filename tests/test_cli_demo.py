"""``kvcanary demo``: the JSON contract, the exit codes, and that both failure modes turn into exit 1."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from kvcanary import cli, demo
from kvcanary.adapters import UnsupportedEngineVersion


def test_demo_json_run_passes(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--json", "--quiet"]) == cli.EXIT_OK
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"passed", "engine", "clean", "faulted"} and out["passed"] is True
    assert set(out["clean"]) == {"steps", "verified_slots", "violations"}
    assert set(out["faulted"]) == {
        "fault", "injected_step", "injected_request", "detected", "first_detection_step", "violations", "first_report"
    }  # fmt: skip
    first = out["faulted"]["first_report"]
    assert first["step"] >= out["faulted"]["injected_step"] >= 0 and first["lines"]
    assert all(f"request={out['faulted']['injected_request']!r}" in line for line in first["lines"][:1]) or any(
        repr(out["faulted"]["injected_request"]) in line for line in first["lines"]
    )
    assert out["clean"]["violations"] == 0 and out["clean"]["steps"] > 100 and out["clean"]["verified_slots"] > 0
    assert out["faulted"]["fault"] == demo.DEFAULT_FAULT and out["faulted"]["detected"] is True
    assert out["faulted"]["violations"] > 0 and out["faulted"]["first_detection_step"] >= 0


def fake_result(clean_violations: int, detected: bool) -> demo.DemoResult:
    from kvcanary.selftest.protocol import Injection

    stats = {"steps": 10, "verified_slots": 100, "violations": clean_violations, "stamped": 50, "tap_us": 900}
    features = dict.fromkeys(
        ["prefix_hits", "prefix_tokens", "cached_block_reuse", "dedup_swaps", "forks", "fork_block_copies"], 1
    ) | {"offloads": 1, "restores": 1, "ring_wraps": 0}
    injected = Injection(3, "read index redirected", ("req_1",))
    clean = demo.RunResult(stats, features, 1.0, 8, [])
    faulted = demo.RunResult(dict(stats, violations=0), features, 1.0, 8, [], None, injected)
    assert faulted.detected is False
    if detected:
        from kvcanary.runtime import StepReport

        report = StepReport(3, 4, (), ("req_1",), {"position_mismatch": 1}, {"full_attention": 1}, 1, 1)
        faulted = demo.RunResult(dict(stats, violations=1), features, 1.0, 8, [report], 3, injected)
    return demo.DemoResult(demo.DemoOptions(), "5.24.0", clean, faulted)


@pytest.mark.parametrize(("clean_violations", "detected", "code"), [(0, True, 0), (2, True, 1), (0, False, 1)])
def test_exit_code_is_zero_only_for_a_silent_clean_run_and_a_caught_fault(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    clean_violations: int,
    detected: bool,
    code: int,
) -> None:
    monkeypatch.setattr(demo, "run_demo", lambda options, progress=None: fake_result(clean_violations, detected))
    assert cli.main(["demo", "--quiet"]) == code
    text = capsys.readouterr().out
    assert ("result: PASS" in text) == (code == 0)
    if clean_violations:
        assert "the clean run raised 2 violations" in text
    if not detected:
        assert "NOT caught" in text


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--model", "bogus"])
    assert exc.value.code == cli.EXIT_USAGE
    assert cli.main(["demo", "--requests", "0"]) == cli.EXIT_USAGE
    assert "requests >= 1" in capsys.readouterr().err
    assert cli.main(["demo", "--baseline", "--rounds", "0"]) == cli.EXIT_USAGE
    assert "rounds" in capsys.readouterr().err
    assert cli.main(["demo", "--rounds", "5"]) == cli.EXIT_USAGE  # timed pairs without --baseline: nothing to time
    assert "needs baseline" in capsys.readouterr().err


def test_unsupported_engine_exits_3(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(options: object, progress: object = None) -> None:
        raise UnsupportedEngineVersion("transformers 5.23.0 is installed")

    monkeypatch.setattr(demo, "run_demo", refuse)
    assert cli.main(["demo", "--quiet"]) == cli.EXIT_ENVIRONMENT
