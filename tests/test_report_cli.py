"""``kvcanary report EVENTS.jsonl``: the summary of an event log written by a real engine run with a fault
(transformers continuous batching, the runtime's own EventLog), and the errors (exit 2, never a traceback)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from kvcanary import cli
from kvcanary.events_report import read_summary


def report(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = cli.main(["report", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_report_of_a_faulted_run(faulted_log: tuple[Path, dict[str, Any]], capsys: pytest.CaptureFixture[str]) -> None:
    path, run = faulted_log
    rc, out, err = report(capsys, str(path))
    injected = run["injected"]
    assert rc == cli.EXIT_CHECK_FAILED and err == ""
    assert f"{run['stats']['violations']} violation row(s)" in out
    assert "by reason:" in out and "link_mismatch" in out and "by group:" in out and "full_attention" in out
    assert f'"{injected.requests[0]}"' in out  # by request
    assert "timeline (step: rows):" in out and "first " in out and f"request {injected.requests[0]!r}" in out
    assert "last stats" in out


def test_json_report_matches_the_run(
    faulted_log: tuple[Path, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    path, run = faulted_log
    rc, out, _ = report(capsys, str(path), "--json", "--first", "2")
    doc = json.loads(out)
    injected = run["injected"]
    assert rc == cli.EXIT_CHECK_FAILED and doc["clean"] is False and doc["schema"] == 1
    assert doc["violation_rows"] == run["stats"]["violations"] == sum(t["rows"] for t in doc["timeline"])
    assert doc["by_group"] == {"full_attention": doc["violation_rows"]}
    assert doc["by_request"] == {json.dumps(injected.requests[0]): doc["rows_kept"]}
    assert doc["by_reason"]["link_mismatch"] > 0 and doc["rows_dropped"] == 0
    assert doc["timeline"][0]["step"] >= injected.step  # nothing reported before the injection
    assert len(doc["first_violations"]) == 2
    first = doc["first_violations"][0]
    assert first["request_id"] == injected.requests[0] and first["group"] == "full_attention"
    assert doc["last_stats"]["violations"] <= doc["violation_rows"]


def test_report_of_a_clean_run(clean_log: tuple[Path, dict[str, Any]], capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = clean_log
    rc, out, _ = report(capsys, str(path))
    assert rc == cli.EXIT_OK and "no violations and no failed health checks recorded" in out
    rc, out, _ = report(capsys, str(path), "--json")
    doc = json.loads(out)
    assert doc["clean"] is True and doc["violation_rows"] == 0 and doc["last_stats"]["verified_slots"] > 0


def _write(path: Path, lines: list[object]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


STATS = {"schema": 1, "event": "stats", "time": 1.0, "step": 3, "violations": 0}


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([STATS, STATS, {**STATS, "schema": 2}], "line 3: event log schema version 2; this kvcanary reads version 1"),
        ([STATS, "", "not json"], "line 3: not a kvcanary event log (not JSON"),
        ([[1, 2]], "line 1: not a kvcanary event (no 'schema' and 'event' keys)"),
        ([{"schema": 1, "event": "step", "time": 1.0}], "line 1: a 'step' event without an integer 'step'"),
    ],
)
def test_bad_logs_exit_2_naming_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], lines: list[object], message: str
) -> None:
    path = _write(tmp_path / "log.jsonl", lines)
    rc, out, err = report(capsys, str(path))
    assert rc == cli.EXIT_USAGE and out == "" and message in err and err.startswith("kvcanary report: ")


def test_missing_file_and_directory_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = report(capsys, str(tmp_path / "nope.jsonl"))
    assert rc == cli.EXIT_USAGE and "nope.jsonl: no such file" in err
    rc, _, err = report(capsys, str(tmp_path))
    assert rc == cli.EXIT_USAGE and "is a directory" in err
    rc, _, err = report(capsys, str(tmp_path / "nope.jsonl"), "--first", "-1")
    assert rc == cli.EXIT_USAGE and "--first must be >= 0" in err


def test_unknown_kinds_and_keys_are_ignored(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path / "log.jsonl", [{**STATS, "new_key": 1}, {"schema": 1, "event": "future", "step": 9}])
    rc, out, _ = report(capsys, str(path))
    assert rc == cli.EXIT_OK and "1 event(s) of kinds this version does not know were ignored" in out


def test_a_cut_off_last_line_is_left_out(faulted_log: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    whole = faulted_log[0].read_text()
    cut = tmp_path / "killed.jsonl"
    cut.write_text(whole + whole.splitlines()[0][:40])  # the writer killed mid-line: no newline at the end
    rc = cli.main(["report", str(cut), "--json"])
    assert rc == cli.EXIT_CHECK_FAILED
    doc, full = read_summary(cut), read_summary(faulted_log[0])
    assert doc.incomplete_tail and not full.incomplete_tail and doc.events == full.events
    cut.write_text(whole.splitlines()[0][:40] + "\n" + whole)  # the same cut inside the file is an error
    assert cli.main(["report", str(cut)]) == cli.EXIT_USAGE


def test_help_lists_exit_codes_and_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["report", "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and "exit codes:" in out and "schema version" in out and "--plot" in out
    with pytest.raises(SystemExit) as exc:
        cli.main(["report", "x.jsonl", "--bogus"])
    assert exc.value.code == cli.EXIT_USAGE and "usage: kvcanary report" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "report" in capsys.readouterr().out


def test_the_installed_command_prints_no_traceback(tmp_path: Path) -> None:
    path = _write(tmp_path / "log.jsonl", [STATS, {**STATS, "schema": 0}])
    done = subprocess.run(
        [sys.executable, "-m", "kvcanary", "report", str(path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "line 2: event log schema version 0" in done.stderr
