"""The schema's codes as kernel constants, each defined once (jit code reads a global only as a constexpr).

Reason bits grouped by the check that sets them, the phases the link kernels log, the plan workspace's row
states and same-step mark layout, the never-stored token, and the digest's reason, counter lanes, phases
and statistics; each kernel module imports the ones it uses.
"""

from __future__ import annotations

from kvcanary.digest import DigestWorkspace
from kvcanary.ops.kernels.const import const
from kvcanary.schema import NOT_STORED as _NOT_STORED
from kvcanary.schema import Phase, Reason
from kvcanary.workspace import PlanWorkspace


def _consts(*values: int) -> tuple[const, ...]:
    return tuple(const(int(v)) for v in values)


# plan: a batch row's table row, its lengths, its lookup and its seed
ROW_OOR, LENGTH_OOR, LOOKUP_OOR, SEED_OOR = _consts(
    Reason.ROW_OUT_OF_RANGE, Reason.LENGTH_OUT_OF_RANGE, Reason.LOOKUP_OUT_OF_RANGE, Reason.SEED_OUT_OF_RANGE
)
# verify: a read's record against the chain
LINK_BAD, POSITION_BAD, TOKEN_BAD, NEVER_WRITTEN = _consts(
    Reason.LINK_MISMATCH, Reason.POSITION_MISMATCH, Reason.TOKEN_MISMATCH, Reason.NEVER_WRITTEN
)
# verify and stamp: an index on a reserved slot or outside the pool, a predecessor outside it
RESERVED, SLOT_OOR, PRED_OOR = _consts(Reason.RESERVED_SLOT, Reason.SLOT_OUT_OF_RANGE, Reason.PREDECESSOR_OUT_OF_RANGE)
# stamp: a written token against its place, and against the step's other reads and writes
WRITE_POSITION_BAD, WRITE_TOKEN_BAD = _consts(Reason.WRITE_POSITION_MISMATCH, Reason.WRITE_TOKEN_MISMATCH)
INTO_LIVE, DUPLICATE, NEW_READ_BAD = _consts(
    Reason.WRITE_INTO_LIVE_SLOT, Reason.DUPLICATE_WRITE, Reason.NEW_READ_MISMATCH
)
PHASE_PLAN, PHASE_VERIFY, PHASE_STAMP = _consts(Phase.PLAN, Phase.VERIFY, Phase.STAMP)
# the plan workspace: a row's state, and the same-step marks' period and reader field
ACTIVE, PADDING, BAD = _consts(PlanWorkspace.ROW_ACTIVE, PlanWorkspace.ROW_PADDING, PlanWorkspace.ROW_BAD)
MARK_PERIOD, READER_BITS, READER_LIMIT = _consts(
    PlanWorkspace.MARK_PERIOD, PlanWorkspace.READER_BITS, PlanWorkspace.READER_LIMIT
)
NOT_STORED = const(_NOT_STORED)
# the digest: a mismatch, the counter lanes of its two reasons (an index outside the pool is SLOT_OOR), its
# phases, and the statistics its workspace keeps
DIGEST_BAD = const(int(Reason.DIGEST_MISMATCH))
DIGEST_BAD_LANE, SLOT_OOR_LANE = _consts(
    int(Reason.DIGEST_MISMATCH).bit_length() - 1, int(Reason.SLOT_OUT_OF_RANGE).bit_length() - 1
)
PHASE_DIGEST_STAMP, PHASE_DIGEST_VERIFY = _consts(Phase.DIGEST_STAMP, Phase.DIGEST_VERIFY)
STAT_STAMPED, STAT_VERIFIED, STAT_SKIPPED_TILES, STAT_CALLS = _consts(
    DigestWorkspace.STAT_STAMPED, DigestWorkspace.STAT_VERIFIED, DigestWorkspace.STAT_SKIPPED_TILES,
    DigestWorkspace.STAT_CALLS,
)  # fmt: skip
