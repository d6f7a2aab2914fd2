"""The figures: ``report --plot`` (timeline of a real faulted run's event log), ``selftest --plot`` (the
detection matrix of a real narrow self-test) and the benchmark plot of ``benchmarks/make_readme.py``;
each is written, then opened as an image.  Without matplotlib the commands exit 3 with the install hint."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from PIL import Image

from kvcanary import cli

ROOT = Path(__file__).resolve().parents[1]


def open_png(path: Path) -> tuple[int, int]:
    """The image's size, after decoding all of it (a truncated or empty file fails here)."""
    import matplotlib.image

    assert path.stat().st_size > 0
    with Image.open(path) as image:
        assert image.format == "PNG"
        image.load()
        size = image.size
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[:2] == (size[1], size[0]) and pixels.std() > 0  # not a blank canvas
    return size


def test_report_plot_of_a_faulted_run(
    faulted_log: tuple[Path, dict[str, Any]],
    clean_log: tuple[Path, dict[str, Any]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name, (log, _) in (("faulted", faulted_log), ("clean", clean_log)):
        out = tmp_path / f"{name}.png"
        rc = cli.main(["report", str(log), "--plot", str(out)])
        assert rc == (cli.EXIT_CHECK_FAILED if name == "faulted" else cli.EXIT_OK)
        assert f"timeline written to {out}" in capsys.readouterr().out
        width, height = open_png(out)
        assert width >= 600 and height >= 300


def test_selftest_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "matrix.png"
    rc = cli.main(
        ["selftest", "--faults", "wrong-token-id,kv-bit-flip", "--trials", "2", "--quiet", "--plot", str(out)]
    )
    captured = capsys.readouterr()
    assert rc == cli.EXIT_OK and "result: PASS" in captured.out  # the text output stays
    assert f"detection matrix drawn into {out}" in captured.err
    width, height = open_png(out)
    assert width >= 1000 and height >= 200


def _no_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)  # import now raises ImportError


def test_plots_without_matplotlib_exit_3(
    faulted_log: tuple[Path, dict[str, Any]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvcanary.selftest import runner

    _no_matplotlib(monkeypatch)
    out = tmp_path / "x.png"
    assert cli.main(["report", str(faulted_log[0]), "--plot", str(out)]) == cli.EXIT_ENVIRONMENT
    assert "pip install 'matplotlib>=3.8'" in capsys.readouterr().err and not out.exists()

    def no_runs(*args: object, **kwargs: object) -> None:
        raise AssertionError("selftest ran before refusing --plot")

    monkeypatch.setattr(runner, "run_selftest", no_runs)
    assert cli.main(["selftest", "--faults", "dropped-write", "--plot", str(out)]) == cli.EXIT_ENVIRONMENT
    assert "plots extra" in capsys.readouterr().err


def _make_readme() -> Any:
    spec = importlib.util.spec_from_file_location("make_readme", ROOT / "benchmarks" / "make_readme.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "benchmarks"))  # its sibling modules (digest_readme), as when run as a script
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


def test_benchmark_plot_is_generated_and_linked(tmp_path: Path) -> None:
    make_readme = _make_readme()
    out = make_readme.plot(tmp_path / make_readme.PLOT)
    width, height = open_png(out)
    assert width >= 800 and height >= 400
    assert f"]({make_readme.PLOT})" in make_readme.render()  # the generated README shows it
    assert (ROOT / "benchmarks" / make_readme.PLOT).is_file()  # the committed copy the READMEs link
    assert f"(benchmarks/{make_readme.PLOT})" in (ROOT / "README.md").read_text()


def test_the_top_readme_performance_table_is_the_generated_one() -> None:
    make_readme = _make_readme()
    text = (ROOT / "README.md").read_text()
    assert make_readme.top_table() in text, "README's performance table is stale: run benchmarks/make_readme.py"
