"""The violation vocabulary shared by the reference, the kernels and the runtime.

Reasons are bits: one row may fail several checks.  Rows are int64 vectors with the fields below.
The counters vector holds one count per reason, then the totals.  ``docs/design.md`` explains each.
"""

from __future__ import annotations

import enum


class Reason(enum.IntFlag):
    """Bit i is the i-th member (``auto``), which is also its counter's index and its place in ``REASONS``:
    logs and kernels store these bits, so a new reason goes last and none is ever reordered."""

    LINK_MISMATCH = enum.auto()
    POSITION_MISMATCH = enum.auto()
    TOKEN_MISMATCH = enum.auto()
    NEVER_WRITTEN = enum.auto()
    RESERVED_SLOT = enum.auto()
    SLOT_OUT_OF_RANGE = enum.auto()
    PREDECESSOR_OUT_OF_RANGE = enum.auto()
    LOOKUP_OUT_OF_RANGE = enum.auto()
    SEED_OUT_OF_RANGE = enum.auto()
    WRITE_POSITION_MISMATCH = enum.auto()
    WRITE_TOKEN_MISMATCH = enum.auto()
    ROW_OUT_OF_RANGE = enum.auto()
    LENGTH_OUT_OF_RANGE = enum.auto()
    WRITE_INTO_LIVE_SLOT = enum.auto()  # a write lands on a slot attention reads as live this step
    DUPLICATE_WRITE = enum.auto()  # two tokens of one step write one slot
    NEW_READ_MISMATCH = enum.auto()  # a new token's table entry does not resolve to the slot it writes
    DIGEST_MISMATCH = enum.auto()  # a slot's K/V bytes no longer match the digest stamped when they landed


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
