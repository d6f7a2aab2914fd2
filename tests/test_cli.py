"""The top-level command line: version, ``python -m``, exit codes in every help, refusals before work."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kvcanary
from kvcanary import cli
from kvcanary.cli_checks import EXIT_ENVIRONMENT, EXIT_USAGE


def test_version_and_python_dash_m() -> None:
    run = subprocess.run([sys.executable, "-m", "kvcanary", "--version"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == f"kvcanary {kvcanary.__version__}"


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["selftest", "--help"]])
def test_every_help_lists_the_exit_codes(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    out = capsys.readouterr().out
    assert exc.value.code == 0 and "exit codes:" in out and "  3  " in out


def test_an_unknown_demo_option_prints_demo_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--bogus"])
    err = capsys.readouterr().err
    assert exc.value.code == EXIT_USAGE
    assert "usage: kvcanary demo" in err and "--bogus" in err


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = cli.main(["demo", "--quiet", *argv])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "code", "words"),
    [
        (["--async-batching"], EXIT_USAGE, "--async-batching needs --device cuda"),
        (["--cuda-graphs"], EXIT_USAGE, "--cuda-graphs needs --device cuda"),
        (
            ["--no-queue-moves"],
            EXIT_USAGE,
            "--no-queue-moves needs --device cuda (the queue rides the canary's step graph, on CUDA only)",
        ),
        (["--device", "tpu"], EXIT_USAGE, "--device must be cpu or cuda"),
    ],
)
def test_impossible_demo_options_are_refused_at_once(
    argv: list[str], code: int, words: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvcanary import demo

    monkeypatch.setattr(demo, "run_demo", lambda *a, **k: pytest.fail("the run must not start"))
    rc, err = _refused(argv, capsys)
    assert rc == code and words in err


def test_cuda_without_a_device_is_an_environment_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from kvcanary import demo

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(demo, "run_demo", lambda *a, **k: pytest.fail("the run must not start"))
    rc, err = _refused(["--device", "cuda"], capsys)
    assert rc == EXIT_ENVIRONMENT and "no CUDA device" in err


def test_triton_on_cpu_needs_the_interpreter(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("triton")
    from kvcanary import demo

    monkeypatch.setattr(demo, "run_demo", lambda *a, **k: pytest.fail("the run must not start"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rc, err = _refused(["--backend", "triton"], capsys)
    assert rc == EXIT_USAGE and "TRITON_INTERPRET=1" in err
    monkeypatch.setenv("TRITON_INTERPRET", "1")

    class Started(Exception):
        pass

    def start(options: object, progress: object = None) -> None:
        raise Started

    monkeypatch.setattr(demo, "run_demo", start)
    with pytest.raises(Started):  # with the interpreter on, the run starts
        cli.main(["demo", "--quiet", "--backend", "triton"])


def test_a_reader_that_leaves_early_gets_no_traceback() -> None:
    # `kvcanary ... | head`: the pipe's reader is gone before the output is written
    import os

    read_end, write_end = os.pipe()
    os.close(read_end)
    run = subprocess.run(
        [sys.executable, "-m", "kvcanary", "selftest", "--list"],
        stdout=write_end,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
    )
    os.close(write_end)
    assert "Traceback" not in run.stderr and run.returncode == cli.EXIT_CHECK_FAILED, run.stderr
