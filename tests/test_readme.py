"""The README's generic-engine example runs as written and does what its text says."""

from __future__ import annotations

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _block_after(marker: str) -> str:
    text = README.read_text()
    start = text.index(marker)
    match = re.compile(r"```python\n(.*?)```\n", re.S).search(text, start)
    assert match is not None, f"no python block after {marker!r}"
    return match.group(1)


def test_the_generic_engine_example_runs_and_fails_the_corrupted_request(capsys: pytest.CaptureFixture[str]) -> None:
    code = _block_after("Any other engine fills the canonical batch itself")
    scope: dict[str, object] = {"__name__": "readme_example"}
    exec(compile(code, str(README), "exec"), scope)  # the example asserts its own outcome too
    assert scope["failed"] == ["req-b"]
    assert "2 violations; failed: ['req-b']" in capsys.readouterr().out


def test_the_reasons_table_lists_every_reason() -> None:
    from kvcanary.schema import REASON_NAMES

    text = README.read_text()
    table = text[text.index("## Violation reasons") : text.index("## Configuration")]
    missing = [name for name in REASON_NAMES if f"`{name}`" not in table]
    assert not missing, f"README's reasons table misses {missing}"
