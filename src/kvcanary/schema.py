"""The violation vocabulary shared by the reference, the kernels and the runtime.

Reasons are bits: one row may fail several checks.  Rows are int64 vectors with the fields below.
The counters vector holds one count per reason, then the totals.  ``docs/design.md`` explains each.
"""

from __future__ import annotations

import enum

# Bit i is the i-th name (``1 << i``), which is also its counter's index and its place in ``REASONS``: logs and
# kernels store these bits, so a new reason goes last and none is ever reordered.  One line a family of checks.
Reason = enum.IntFlag("Reason", [
    # a read's record does not chain to its predecessor, or was never written (verify)
    "LINK_MISMATCH", "POSITION_MISMATCH", "TOKEN_MISMATCH", "NEVER_WRITTEN",
    # an index lands on a reserved slot, or outside the pool or the full->window lookup
    "RESERVED_SLOT", "SLOT_OUT_OF_RANGE", "PREDECESSOR_OUT_OF_RANGE", "LOOKUP_OUT_OF_RANGE", "SEED_OUT_OF_RANGE",
    # a written token is not the one expected at its place (stamp)
    "WRITE_POSITION_MISMATCH", "WRITE_TOKEN_MISMATCH",
    # a batch row's table row or lengths are out of range (plan)
    "ROW_OUT_OF_RANGE", "LENGTH_OUT_OF_RANGE",
    # a write against the same step's reads and writes: onto a live slot, twice, or where its own read goes (stamp)
    "WRITE_INTO_LIVE_SLOT", "DUPLICATE_WRITE", "NEW_READ_MISMATCH",
    # a slot's K/V bytes no longer match the digest stamped when they landed (digest verify)
    "DIGEST_MISMATCH",
])  # fmt: skip


REASONS: tuple[Reason, ...] = tuple(Reason)
NUM_REASONS = len(REASONS)


REASON_NAMES: tuple[str, ...] = tuple(str(r.name).lower() for r in REASONS)  # as logs and metrics spell them


def reason_names(bits: int) -> list[str]:
    """Lower-case names of the reasons set in ``bits``, in bit order."""
    return [name for r, name in zip(REASONS, REASON_NAMES, strict=True) if bits & r]


class Phase(enum.IntEnum):
    PLAN = 0
    VERIFY = 1
    STAMP = 2
    DIGEST_STAMP = 3  # the KV digest of the slots written this step
    DIGEST_VERIFY = 4  # the KV digest of (a budgeted share of) the slots read this step, or of moved slots


class Field(enum.IntEnum):
    """Columns of a violation row (int64)."""

    REASONS = 0
    PHASE = 1
    GROUP = 2
    BATCH_ROW = 3  # index into the step's batch
    TABLE_ROW = 4  # the request's row in the token/block table
    SLOT = 5  # resolved pool slot, -1 when it could not be resolved
    PRED = 6  # resolved predecessor slot (verify), -1 when none
    EXPECTED_POSITION = 7  # plan rows: prefix_len
    STORED_POSITION = 8  # stamp rows: the written position; plan rows: prefix_len + extend_len
    EXPECTED_TOKEN = 9  # -1 when unknown
    STORED_TOKEN = 10  # stamp rows: the written token
    EXPECTED_LINK = 11  # verify rows: link recomputed from the predecessor, 0 when not computed
    STORED_LINK = 12  # stamp rows: the written link
    # The index that was out of range, -1 when none.  Stamp rows: write_into_live_slot, the writing batch row
    # (the row names the reader); new_read_mismatch, the new token's own table entry.
    # Digest rows: EXPECTED_LINK is the stored digest, STORED_LINK the one recomputed from the bytes now.
    BAD_INDEX = 13


ROW_WIDTH = len(Field)


class Counter(enum.IntEnum):
    """Slots after the per-reason counts in the counters vector."""

    VIOLATIONS = NUM_REASONS  # rows appended to the log
    VERIFIED = NUM_REASONS + 1  # verify entries checked
    SKIPPED = NUM_REASONS + 2  # verify entries over capacity, not checked
    STAMPED = NUM_REASONS + 3  # records written
    CALLS = NUM_REASONS + 4  # plan/verify/stamp calls that ran


NUM_COUNTERS = NUM_REASONS + 5

UNKNOWN_TOKEN = -1
NO_SLOT = -1
NOT_STORED = -1  # out_cache_loc value of a token that is computed but not kept in the pool
