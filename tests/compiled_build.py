"""Whether the modules a test patches are compiled (setup.py's KVCANARY_COMPILE build, see scripts/test_compiled.sh).

A compiled module's classes take no new attributes or methods and its functions call each other directly, so a test
that swaps one of its internals for a recording stand-in cannot run on that build: it runs on the pure-Python build,
which CI tests in full, and is skipped, saying so, on the compiled one.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest


def is_compiled(module: ModuleType) -> bool:
    return not str(module.__file__).endswith(".py")


def patches(*modules: str) -> pytest.MarkDecorator:
    """Skip where any of the named ``modules`` is compiled: the test replaces some of their internals."""
    names = [name for name in modules if is_compiled(importlib.import_module(name))]
    return pytest.mark.skipif(bool(names), reason=f"patches internals of compiled modules {names}")
