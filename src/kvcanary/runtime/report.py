"""Decoded violations, per-step reports, the exceptions, and the log line formats.

One-line format (stable; one line per violation row, parsed by tools, never reworded)::

    kvcanary violation: step=<S> group=<G> phase=<P> reasons=<r1+r2> request=<ID> batch_row=<B> \
table_row=<T> slot=<N> pred=<N> position=<expected> stored_position=<stored> token=<expected> \
stored_token=<stored> link=0x<16 hex> stored_link=0x<16 hex> bad_index=<N>[ rank=<R>]

(one line; wrapped here; `` rank=<R>`` only in a verdict shared by several ranks, naming the rank that
found the row).  ``step`` is the host step the violation happened at, ``group`` the group's
name, ``phase`` one of ``plan``/``verify``/``stamp``, ``reasons`` the lower-case reason names joined
by ``+`` (:func:`kvcanary.schema.reason_names`), ``request`` the engine's request id (``repr`` of
the object; ``-`` when unknown).  Numbers are decimal, ``-1`` means "none/unknown" (see
:class:`kvcanary.schema.Field`); links are the unsigned 64-bit value as 16 hex digits (``0x0...0``
when not computed).  Field meanings by phase: verify rows compare the record stored in ``slot``
(stored_*) against what the batch implies (position, token) and the link recomputed from ``pred``;
stamp rows report the written token/position (stored_*) against what was expected; plan rows carry
``position=prefix_len`` and ``stored_position=prefix_len+extend_len``.

Human-readable block (free text, may change between versions): a header line
``kvcanary: <n> violation(s) at step <S> (reported at step <R>); requests: <ids>``, one indented
paragraph per kept row (values that were not computed left out; a culprit note from
:mod:`kvcanary.runtime.culprit` where it applies), then the per-reason counts and how many rows were
dropped (the device log keeps only the first K and last K rows per group and step).  In ``log``
mode each row is logged once, as its line, followed by :meth:`StepReport.summary` (header, culprit
notes, counts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from kvcanary.hashing import to_unsigned64
from kvcanary.schema import Field, Phase, reason_names

_PHASE_NAMES = {int(p): p.name.lower() for p in Phase}


@dataclasses.dataclass(frozen=True)
class Violation:
    """One decoded violation row (see :class:`kvcanary.schema.Field` for each field's meaning)."""

    reasons: tuple[str, ...]
    reason_bits: int
    phase: str
    group: str
    group_id: int
    batch_row: int
    request_id: object | None
    table_row: int
    slot: int
    pred: int
    expected_position: int
    stored_position: int
    expected_token: int
    stored_token: int
    expected_link: int  # unsigned 64-bit
    stored_link: int  # unsigned 64-bit
    bad_index: int
    note: str = ""  # the report's reading of the row (runtime.culprit), free text; "" when none
    rank: int | None = None  # the process group rank that found the row, when several ranks share a verdict

    def line(self, step: int) -> str:
        """The stable one-line format (module docstring)."""
        req = "-" if self.request_id is None else repr(self.request_id)
        return (
            f"kvcanary violation: step={step} group={self.group} phase={self.phase} "
            f"reasons={'+'.join(self.reasons)} request={req} batch_row={self.batch_row} "
            f"table_row={self.table_row} slot={self.slot} pred={self.pred} "
            f"position={self.expected_position} stored_position={self.stored_position} "
            f"token={self.expected_token} stored_token={self.stored_token} "
            f"link=0x{self.expected_link:016x} stored_link=0x{self.stored_link:016x} bad_index={self.bad_index}"
            + ("" if self.rank is None else f" rank={self.rank}")
        )

    def describe(self) -> str:
        """A few human-readable lines for the log block; values that were not computed are left out."""
        who = "unknown request" if self.request_id is None else f"request {self.request_id!r}"
        on = "" if self.rank is None else f" on rank {self.rank}"
        where = f"  [{self.group}]{on} {who} (batch row {self.batch_row}, table row {self.table_row}): "
        reasons = ", ".join(self.reasons)
        if self.phase == "plan":
            lengths = f"prefix_len={self.expected_position} prefix_len+extend_len={self.stored_position}"
            lines = [f"{where}plan of the row: {reasons}", f"    {lengths}"]
        else:
            lines = [f"{where}{self.phase} of slot {self.slot} at position {self.expected_position}: {reasons}"]
            lines.append(f"    stored: {self._stored()}; expected: {self._expected()}")
        if self.bad_index >= 0:
            lines.append(f"    out-of-range index: {self.bad_index}")
        if self.note:
            lines.append(f"    {self.note}")
        return "\n".join(lines)

    def _stored(self) -> str:
        if self.phase == "verify" and self.stored_link == 0:  # links are odd once written
            return "nothing (never written)"
        return f"token={self.stored_token} position={self.stored_position} link=0x{self.stored_link:016x}"

    def _expected(self) -> str:
        tok = "unknown" if self.expected_token < 0 else str(self.expected_token)
        out = f"token={tok} position={self.expected_position}"
        if self.expected_link != 0:  # 0: not computed (no usable predecessor, or a stamp row)
            pred = f" from predecessor slot {self.pred}" if self.pred >= 0 else " from the anchor"
            out += f" link=0x{self.expected_link:016x}{pred}"
        return out


def decode_row(row: Sequence[int], group: str, request_ids: Sequence[object] | None) -> Violation:
    """Turn one int64 log row into a :class:`Violation`; the request id comes from its batch row."""
    bits = int(row[Field.REASONS])
    batch_row = int(row[Field.BATCH_ROW])
    rid = request_ids[batch_row] if request_ids is not None and 0 <= batch_row < len(request_ids) else None
    return Violation(
        reasons=tuple(reason_names(bits)),
        reason_bits=bits,
        phase=_PHASE_NAMES.get(int(row[Field.PHASE]), f"phase{int(row[Field.PHASE])}"),
        group=group,
        group_id=int(row[Field.GROUP]),
        batch_row=batch_row,
        request_id=rid,
        table_row=int(row[Field.TABLE_ROW]),
        slot=int(row[Field.SLOT]),
        pred=int(row[Field.PRED]),
        expected_position=int(row[Field.EXPECTED_POSITION]),
        stored_position=int(row[Field.STORED_POSITION]),
        expected_token=int(row[Field.EXPECTED_TOKEN]),
        stored_token=int(row[Field.STORED_TOKEN]),
        expected_link=to_unsigned64(int(row[Field.EXPECTED_LINK])),
        stored_link=to_unsigned64(int(row[Field.STORED_LINK])),
        bad_index=int(row[Field.BAD_INDEX]),
    )


@dataclasses.dataclass(frozen=True)
class StepReport:
    """Everything the canary found in one host step.

    ``counts`` (per reason name) and ``group_counts`` (violation rows per group) are exact; the
    decoded ``violations`` are the rows the device log kept (first K and last K per group, of the
    step's last forward), so ``rows_dropped`` > 0 means ``affected_request_ids`` may be incomplete.
    """

    step: int  # the host step the violations happened at
    reported_at: int  # the host step (or flush) that decoded them
    violations: tuple[Violation, ...]
    affected_request_ids: tuple[object, ...]
    counts: dict[str, int]
    group_counts: dict[str, int]
    total: int  # violation rows counted on device
    rows_dropped: int

    def lines(self) -> list[str]:
        return [v.line(self.step) for v in self.violations]

    def block(self) -> str:
        """The human-readable block (free text): header, one paragraph per kept row, counts."""
        return "\n".join([self._header(), *(v.describe() for v in self.violations), self._counts()])

    def summary(self) -> str:
        """The block without the per-row paragraphs (log mode logs each row once, as its line)."""
        notes = [
            f"  {v.group} request {v.request_id!r} position {v.expected_position}: {v.note}"
            for v in self.violations
            if v.note.startswith(("likely culprit", "digest:"))
        ]
        return "\n".join([self._header(), *notes, self._counts()])

    def _header(self) -> str:
        ids = ", ".join(repr(r) for r in self.affected_request_ids) or "unknown"
        return (
            f"kvcanary: {self.total} violation(s) at step {self.step} (reported at step {self.reported_at}); "
            f"requests: {ids}"
        )

    def _counts(self) -> str:
        counts = " ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))
        groups = " ".join(f"{k}={v}" for k, v in self.group_counts.items())
        return (
            f"  counts: {counts}; rows per group: {groups}; rows kept {len(self.violations)}, "
            f"dropped {self.rows_dropped}"
        )


FailRequestCallback = Callable[[list[object], StepReport], None]
"""``on_fail_request(request_ids, report)``: fail-request mode's action, given the requests not reported before."""


def affected(violations: Sequence[Violation]) -> tuple[object, ...]:
    """Unique request ids in row order (ids need not be hashable)."""
    seen: list[object] = []
    for v in violations:
        if v.request_id is not None and not any(v.request_id is s or v.request_id == s for s in seen):
            seen.append(v.request_id)
    return tuple(seen)


class CanaryViolation(Exception):
    """Raised in ``raise`` mode with every decoded row of the step."""

    def __init__(self, report: StepReport) -> None:
        super().__init__(report.block())
        self.report = report


class CanaryHealthError(RuntimeError):
    """Raised in ``raise`` mode when the canary's device work did not run (health or phase check)."""
