"""The fault library and ``kvcanary selftest``: proof, on a real engine, of what the canary catches.

Each fault (:data:`FAULTS`) corrupts the engine's own state the way a real engine bug did (each spec
names an example issue) and says whether the canary should detect it, with which
check, or why it cannot.  :func:`run_selftest` runs each in randomized trials on transformers' continuous
batching, judged against an independent oracle of when attention first read corrupted KV, plus clean
controls; :mod:`.report` renders the detection matrix.

Modules: :mod:`.base` (what a fault is), :mod:`.index`, :mod:`.allocator`, :mod:`.prefix`,
:mod:`.rollback`, :mod:`.copies`, :mod:`.data` (the faults, by the engine state they corrupt),
:mod:`.oracle` (first affected read), :mod:`.engine` (one engine run), :mod:`.runner` (trials, controls,
verdicts), :mod:`.report` (table, JSON), :mod:`.command` (the CLI subcommand).
"""

from kvcanary.faults.base import Expect, Fault, FaultSpec
from kvcanary.faults.catalogue import FAULTS
from kvcanary.faults.runner import run_selftest

__all__ = ["FAULTS", "Expect", "Fault", "FaultSpec", "run_selftest"]
