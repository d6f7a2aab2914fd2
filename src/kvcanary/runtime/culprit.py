"""Point a report at the entry that is wrong, not at the healthy entry whose check exposed it.

A verify row's link is recomputed from its predecessor's record, so one wrong table entry at
position q (a slot holding another prefix's token at the same position) fails two links: its own
(it chains from another predecessor) and its successor's at q + 1 (which chains from the true
entry).  Except at q = 0: position 0 chains from the anchor only, so a wrong entry there passes its
own check and only its successor at 1 fails.  Hence, per request and group, among link failures
that the row's own record does not explain (no position or token mismatch):

* a failure right after another flagged position is the consequence of that one;
* a failure whose successor also fails is the culprit;
* a lone failure at position 1 points at its predecessor, the entry at position 0; a lone failure
  elsewhere is the entry itself (the last verified position, whose successor was not checked).

The conclusion is a hint written into :attr:`Violation.note`; the rows themselves are unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvcanary.runtime.report import Violation

_OWN_RECORD = ("position_mismatch", "token_mismatch", "never_written")


def annotate(violations: Sequence[Violation]) -> tuple[Violation, ...]:
    """``violations`` with a culprit note on each link failure the rule above explains."""
    flagged = {_key(v, v.expected_position) for v in violations if v.phase == "verify"}
    out = []
    for v in violations:
        note = _note(v, flagged)
        out.append(dataclasses.replace(v, note=note) if note else v)
    return tuple(out)


def _key(v: Violation, position: int) -> tuple[str, int, int, int]:
    return (v.group, v.batch_row, v.table_row, position)


def _note(v: Violation, flagged: set[tuple[str, int, int, int]]) -> str:
    if v.phase != "verify" or "link_mismatch" not in v.reasons or any(r in v.reasons for r in _OWN_RECORD):
        return ""
    p = v.expected_position
    if _key(v, p - 1) in flagged:
        return f"consequence of the flagged entry at position {p - 1} (its predecessor)"
    if _key(v, p + 1) in flagged:
        return f"likely culprit: this entry (slot {v.slot}); its successor's link fails too"
    if p == 1 and v.pred >= 0:
        return (
            f"likely culprit: the predecessor entry at position 0 (slot {v.pred}), which chains only from "
            "the anchor and so passes its own check; this entry's link does not chain from it"
        )
    return f"likely culprit: this entry (slot {v.slot}) or the record stored there"
