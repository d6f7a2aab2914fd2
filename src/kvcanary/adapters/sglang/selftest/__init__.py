"""The sglang adapter's self-test: sglang's own scheduler loop in process, its workload, faults and driver.

``driver()`` is what ``kvcanary selftest --engine sglang`` loads (through :mod:`kvcanary.selftest.registry`).
Modules: :mod:`.scheduler_loop` (sglang's Scheduler stepped in process on the CPU), :mod:`.tiny_model`
(the offline checkpoint), :mod:`.workload` (the seeded requests), :mod:`.context` (what faults act through,
the read oracle's tap), :mod:`.faults` (the library), :mod:`.driver` (one run).  Importing this package
imports no sglang module; a session builds the scheduler.
"""

from __future__ import annotations

from kvcanary.adapters.sglang.selftest.driver import SglangDriver
from kvcanary.adapters.sglang.selftest.faults import FAULTS

__all__ = ["FAULTS", "SglangDriver", "driver"]


def driver() -> SglangDriver:
    return SglangDriver()
