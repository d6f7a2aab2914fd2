"""The manager's host validation of one step's batches, before any device work.

API misuse (types, shapes, devices, capacities, malformed ground truth) raises, naming the group.
Values that come from the engine's state (lengths, table rows) are not checked here even with value
checks on: the plan reports them as ``length_out_of_range`` / ``row_out_of_range`` violations, so a
corrupt engine is reported by the mode (logged, raised as CanaryViolation, or its requests failed)
instead of an exception out of the engine's forward.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcanary.batch import StepBatch
from kvcanary.canary import GroupCanary


def validate_step(canaries: Sequence[GroupCanary], batches: Sequence[StepBatch], check_values: bool | None) -> None:
    for canary, batch in zip(canaries, batches, strict=True):
        try:
            canary.validate(batch, check_values, engine_values=False)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"group {canary.group.name!r}: {exc}") from None
