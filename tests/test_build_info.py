"""The build the demo reports is the one that runs: on the pure-Python build the step tap loads from its source, on
the compiled one (scripts/test_compiled.sh) from its extension."""

from __future__ import annotations

import compiled_build
from kvcanary.adapters.transformers_cb import step_tap
from kvcanary.build_info import build_name, compiled_step_path


def test_the_reported_build_is_where_the_step_tap_was_loaded_from() -> None:
    compiled = compiled_build.is_compiled(step_tap)
    assert compiled_step_path() is compiled
    assert build_name() == ("compiled per-step path (mypyc)" if compiled else "pure Python")
