"""kvcanary: run-time detection of silent KV-cache corruption in LLM serving engines."""

from kvcanary.batch import StepBatch
from kvcanary.canary import GroupCanary
from kvcanary.config import CanaryConfig, Mode
from kvcanary.layout import CanaryGroup, GroupKind, RecordStore
from kvcanary.ops import Backend
from kvcanary.runtime import CanaryHealthError, CanaryManager, CanaryViolation, StepReport, Violation
from kvcanary.schema import Counter, Field, Phase, Reason, reason_names
from kvcanary.workspace import Capacities, PlanWorkspace, ViolationLog

__all__ = [
    "Backend",
    "CanaryHealthError",
    "CanaryManager",
    "CanaryViolation",
    "CanaryGroup",
    "CanaryConfig",
    "Capacities",
    "Counter",
    "Field",
    "GroupCanary",
    "GroupKind",
    "Mode",
    "Phase",
    "PlanWorkspace",
    "Reason",
    "RecordStore",
    "StepBatch",
    "StepReport",
    "Violation",
    "ViolationLog",
    "reason_names",
]

__version__ = "0.1.0"
