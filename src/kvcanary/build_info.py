"""Which build of kvcanary runs: pure Python, or with the per-step path compiled (setup.py's ``KVCANARY_COMPILE``).

Reported with every timing the demo prints, so that stored numbers say which build made them.
"""

from __future__ import annotations

import importlib.util

# A module of the compiled set (setup.py's COMPILED): where it loads from tells the build.
_PROBE = "kvcanary.adapters.transformers_cb.step_tap"


def compiled_step_path() -> bool:
    """Whether the per-step modules are the compiled extensions (found by the import system, not imported)."""
    spec = importlib.util.find_spec(_PROBE)
    return spec is not None and spec.origin is not None and not spec.origin.endswith(".py")


def build_name() -> str:
    return "compiled per-step path (mypyc)" if compiled_step_path() else "pure Python"
