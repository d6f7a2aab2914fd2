"""``kvcanary selftest``: the JSON contract, the exit codes (pass, a missed 'detect' fault, environment)
and argument errors."""

from __future__ import annotations

import importlib.util
import json

import pytest

pytest.importorskip("transformers")

from kvcanary import cli
from kvcanary.adapters import UnsupportedEngineVersion
from kvcanary.adapters.transformers_cb.selftest import FAULTS, TransformersDriver
from kvcanary.selftest.command import ProgressBar, fault_names

ROW_KEYS = {"fault", "engine", "trials", "detected", "expected", "check"}


def test_json_schema_and_pass(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["selftest", "--faults", "wrong-token-id,kv-bit-flip", "--trials", "1", "--json", "--quiet"])
    out = json.loads(capsys.readouterr().out)
    assert rc == cli.EXIT_OK and out["passed"] is True
    assert set(out["results"][0]) >= ROW_KEYS and set(out["controls"]) >= {"runs", "false_positives"}
    rows = {r["fault"]: r for r in out["results"]}
    assert set(rows) == {"wrong-token-id", "kv-bit-flip"}
    for name, row in rows.items():
        assert row["expected"] == "detect" and row["trials"] == 1 and row["detected"] == 1, name
        assert row["engine"] == "transformers" and row["check"] == FAULTS[name].spec.check and not row["why_miss"]
    assert out["controls"]["runs"] >= 1 and out["controls"]["false_positives"] == 0


def test_table_and_progress(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["selftest", "--faults", "dropped-write", "--trials", "1"]) == cli.EXIT_OK
    captured = capsys.readouterr()
    assert "dropped-write" in captured.out and "1/1" in captured.out and "result: PASS" in captured.out
    assert "controls: 1 clean runs, 0 false positive(s)" in captured.out
    assert "selftest: " in captured.err and "done" in captured.err  # the progress lines (stderr is not a TTY)


def test_a_missed_detect_fault_exits_1(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from kvcanary.runtime.decode import StepDecoder

    monkeypatch.setattr(StepDecoder, "act", lambda self, report, problems: None)  # the canary reports nothing
    rc = cli.main(["selftest", "--faults", "wrong-token-id", "--trials", "1", "--json", "--quiet"])
    out = json.loads(capsys.readouterr().out)
    assert rc == cli.EXIT_CHECK_FAILED and out["passed"] is False
    assert out["results"][0]["expected"] == "detect" and out["results"][0]["detected"] == 0
    assert out["results"][0]["missed"] == 1


def test_unsupported_engine_exits_3(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from kvcanary.adapters.transformers_cb import version

    def refuse(*args: object, **kwargs: object) -> str:
        raise UnsupportedEngineVersion("transformers 0.0 is not supported")

    monkeypatch.setattr(version, "check_version", refuse)
    assert cli.main(["selftest", "--faults", "dropped-write", "--trials", "1", "--quiet"]) == cli.EXIT_ENVIRONMENT
    assert "needs transformers" in capsys.readouterr().err


def test_unknown_fault_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["selftest", "--faults", "dropped-write,no-such-fault"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "no-such-fault" in err and "dropped-write" in err  # names the bad one and lists the choices


@pytest.mark.parametrize(
    "argv",
    [
        ["selftest", "--trials", "0"],
        ["selftest", "--trials", "many"],
        ["selftest", "--engine", "no-such-engine"],
        ["selftest", "--seed", "x"],
        ["selftest", "--faults"],
    ],
)
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == cli.EXIT_USAGE
    assert "usage: kvcanary selftest" in capsys.readouterr().err


def test_list_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["selftest", "--list"]) == cli.EXIT_OK
    listed = capsys.readouterr().out
    assert all(name in listed for name in FAULTS)
    with pytest.raises(SystemExit) as exc:
        cli.main(["selftest", "--help"])
    assert exc.value.code == 0
    assert "exit codes:" in capsys.readouterr().out


def test_fault_names_parsing() -> None:
    assert fault_names(None, FAULTS) is None and fault_names([], FAULTS) is None
    assert fault_names(["dropped-write", "kv-bit-flip,dropped-write"], FAULTS) == [
        "dropped-write",
        "kv-bit-flip",
    ]
    with pytest.raises(ValueError, match="nope"):
        fault_names(["nope"], FAULTS)
    with pytest.raises(ValueError, match="none given"):
        fault_names([" , "], FAULTS)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_an_engine_whose_selftest_cannot_run_here_exits_3_naming_it(
    engine: str, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers")
    if importlib.util.find_spec(engine) is not None:
        pytest.skip(f"{engine} is installed here")
    assert cli.main(["selftest", "--engine", engine, "--trials", "1", "--quiet"]) == cli.EXIT_ENVIRONMENT
    assert f"--engine {engine}" in capsys.readouterr().err


def test_the_registry_loads_a_driver_that_meets_the_protocol() -> None:
    from kvcanary.selftest.registry import DEFAULT_ENGINE, load_driver

    driver = load_driver(DEFAULT_ENGINE)
    assert driver.name == DEFAULT_ENGINE and list(driver.faults) == list(FAULTS)
    assert {cls.spec.model for cls in driver.faults.values()} <= set(driver.workloads)
    with pytest.raises(ValueError, match="unknown engine"):
        load_driver("no-such-engine")


def test_progress_bar_on_a_log_prints_every_tenth() -> None:
    import io

    log = io.StringIO()
    bar = ProgressBar(log)
    for i in range(101):
        bar(i, 100, f"run {i}")
    bar(100, 100, "done")
    lines = log.getvalue().splitlines()
    assert len(lines) == 12 and lines[0].startswith("selftest: 0/100") and lines[-1].endswith("done")


def test_progress_counts_never_go_back() -> None:
    from kvcanary.selftest.runner import run_selftest

    calls: list[tuple[int, int]] = []
    run_selftest(
        TransformersDriver(),
        ["dropped-write"],
        trials=2,
        progress=lambda done, total, label: calls.append((done, total)),
    )
    dones, totals = [c[0] for c in calls], [c[1] for c in calls]
    assert dones == sorted(dones) and totals == sorted(totals), calls
    assert all(d <= t for d, t in calls) and calls[-1][0] == calls[-1][1] >= 4


def test_list_columns_are_aligned(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["selftest", "--list"]) == cli.EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["fault", "expect"] and len(lines) == len(FAULTS) + 1
    expect_col = lines[0].index("expect")
    check_col = lines[0].index("check")
    for line in lines[1:]:
        assert line[expect_col - 2 : expect_col] == "  " and line[expect_col] != " "
        assert line[check_col - 2 : check_col] == "  " and line[check_col] != " "
