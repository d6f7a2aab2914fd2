"""The engine-neutral self-test: proof, on a real engine, of what the canary catches.

Each engine's fault library corrupts the engine's own state the way a real engine bug did (each spec names
an example issue) and says whether the canary should detect it, with which check, or why it cannot.
:func:`run_selftest` runs each fault in randomized trials through the engine's driver, judged against an
independent oracle of when attention first read corrupted KV, plus clean controls.

Modules: :mod:`.protocol` (what a fault is, what an engine's driver implements), :mod:`.read_oracle`
(first affected read), :mod:`.runner` (trials, controls, verdicts, redraws), :mod:`.report` (table, JSON),
:mod:`.registry` (engine name -> its driver, imported lazily), :mod:`.command` (``kvcanary selftest``).
The engines' fault sets and drivers live with their adapters: ``kvcanary.adapters.<engine>.selftest``.
"""

from kvcanary.selftest.protocol import EngineDriver, EngineUnavailable, Expect, Fault, FaultSpec, Injector
from kvcanary.selftest.registry import ENGINES, load_driver
from kvcanary.selftest.runner import run_selftest

__all__ = [
    "ENGINES",
    "EngineDriver",
    "EngineUnavailable",
    "Expect",
    "Fault",
    "FaultSpec",
    "Injector",
    "load_driver",
    "run_selftest",
]
