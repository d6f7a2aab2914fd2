"""The manager's argument checks: its constructor's groups and capacities, each step's batches and ids.

API misuse (types, shapes, devices, capacities, malformed ground truth) raises, naming the group, before
any device work.  Values that come from the engine's state (lengths, table rows) are not checked here
even with value checks on: the plan reports them as ``length_out_of_range`` / ``row_out_of_range``
violations, so a corrupt engine is reported by the mode (logged, raised as CanaryViolation, or its
requests failed) instead of an exception out of the engine's forward.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from kvcanary.batch import StepBatch
from kvcanary.canary import GroupCanary
from kvcanary.layout import CanaryGroup
from kvcanary.workspace import Capacities


def validate_step(canaries: Sequence[GroupCanary], batches: Sequence[StepBatch], check_values: bool | None) -> None:
    for canary, batch in zip(canaries, batches, strict=True):
        try:
            canary.validate(batch, check_values, engine_values=False)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"group {canary.group.name!r}: {exc}") from None


def checked_groups(groups: Sequence[CanaryGroup]) -> list[CanaryGroup]:
    """At least one group, all :class:`CanaryGroup`, with unique names."""
    groups = list(groups)
    if not groups:
        raise ValueError("groups is empty: a manager needs at least one CanaryGroup")
    for g in groups:
        if not isinstance(g, CanaryGroup):
            raise TypeError(f"groups must hold CanaryGroup objects, got {type(g).__name__}")
    names = [g.name for g in groups]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"group names must be unique, repeated: {dup}")
    return groups


def caps_by_name(caps: Capacities | Mapping[str, Capacities], names: list[str]) -> dict[str, Capacities]:
    """One :class:`Capacities` for every group, or one per group name (exactly those names)."""
    if isinstance(caps, Capacities):
        return dict.fromkeys(names, caps)
    if not isinstance(caps, Mapping):
        raise TypeError(f"caps must be Capacities or a mapping of group name to Capacities, got {type(caps)}")
    missing = [n for n in names if n not in caps]
    extra = [n for n in caps if n not in names]
    if missing or extra:
        raise ValueError(f"caps must name exactly the groups {names}; missing {missing}, unknown {extra}")
    for n, c in caps.items():
        if not isinstance(c, Capacities):
            raise TypeError(f"caps[{n!r}] must be Capacities, got {type(c).__name__}")
    return dict(caps)


def ordered_batches(batches: Mapping[str, StepBatch], names: Collection[str]) -> list[StepBatch]:
    """The step's batches in group order: exactly one :class:`StepBatch` per group name."""
    if not isinstance(batches, Mapping):
        raise TypeError(f"batches must be a mapping of group name to StepBatch, got {type(batches).__name__}")
    unknown = [n for n in batches if n not in names]
    missing = [n for n in names if n not in batches]
    if unknown or missing:
        raise ValueError(
            f"batches must hold one StepBatch per group {list(names)}; "
            f"unknown groups {unknown}, missing groups {missing}"
        )
    out = []
    for n in names:
        b = batches[n]
        if not isinstance(b, StepBatch):
            raise TypeError(f"batches[{n!r}] must be a StepBatch, got {type(b).__name__}")
        out.append(b)
    return out


def request_id_tuple(request_ids: Sequence[object] | None) -> tuple[object, ...] | None:
    """One id per batch row as a tuple (None stays None); a string or a non-sequence is refused."""
    if request_ids is None:
        return None
    if type(request_ids) is list or type(request_ids) is tuple:  # the common cases, checked cheaply
        return tuple(request_ids)
    if isinstance(request_ids, (str, bytes)) or not isinstance(request_ids, Sequence):
        raise TypeError(f"request_ids must be a sequence (one id per batch row), got {type(request_ids)}")
    return tuple(request_ids)
