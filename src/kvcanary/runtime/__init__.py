"""The run-time side of the canary: the per-pool manager, the lagged violation pump and reporting.

Formats: the log line format is documented in :mod:`kvcanary.runtime.report`, the JSON-lines event
schema in :mod:`kvcanary.runtime.events`, the Prometheus metric names in :mod:`kvcanary.runtime.metrics`.
"""

from kvcanary.runtime.manager import CanaryManager
from kvcanary.runtime.report import CanaryHealthError, CanaryViolation, FailRequestCallback, StepReport, Violation

__all__ = ["CanaryHealthError", "CanaryManager", "CanaryViolation", "FailRequestCallback", "StepReport", "Violation"]
