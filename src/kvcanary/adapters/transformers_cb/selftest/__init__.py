"""The transformers adapter's self-test: its fault library, fault context and driver.

``driver()`` is what ``kvcanary selftest --engine transformers`` loads (through
:mod:`kvcanary.selftest.registry`).  Modules: :mod:`.context` (what a fault acts through),
:mod:`.index`, :mod:`.allocator`, :mod:`.prefix`, :mod:`.rollback`, :mod:`.copies`, :mod:`.data` (the
faults, by the engine state they corrupt), :mod:`.catalogue` (the library, in matrix order),
:mod:`.workload` (models, prompts, engine configs, shared with the demo), :mod:`.driver` (one run).
"""

from __future__ import annotations

from kvcanary.adapters.transformers_cb.selftest.catalogue import FAULTS
from kvcanary.adapters.transformers_cb.selftest.driver import TransformersDriver

__all__ = ["FAULTS", "TransformersDriver", "driver"]


def driver() -> TransformersDriver:
    return TransformersDriver()
