"""The scalar oracle's state: a step's batch and violation log as plain Python lists, and index resolution.

Shared by :mod:`oracle`'s plan, verify and stamp.  Tensors are read into lists here and written back
at the end of a call; nothing in between touches torch.
"""

from __future__ import annotations

import dataclasses

import torch

from kvcanary.batch import StepBatch
from kvcanary.hashing import to_signed64
from kvcanary.layout import CanaryGroup
from kvcanary.schema import REASONS, ROW_WIDTH, UNKNOWN_TOKEN, Counter, Field, Phase
from kvcanary.workspace import PlanWorkspace, ViolationLog

Rewrites = dict[int, list[tuple[int, int, int]]]  # slot -> every (token, position, link) stamped into it

ROW_ACTIVE, ROW_PADDING, ROW_BAD = PlanWorkspace.ROW_ACTIVE, PlanWorkspace.ROW_PADDING, PlanWorkspace.ROW_BAD


def i32(v: int) -> int:
    """The int32 a value becomes when stored in an int32 tensor (two's complement wrap)."""
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >> 31 else v


def i64(v: int) -> int:
    return to_signed64(v)


def ints(t: torch.Tensor) -> list[int]:
    return [int(x) for x in t.tolist()]


@dataclasses.dataclass
class Batch:
    rows: list[int]
    prefix: list[int]
    extend: list[int]
    table: list[list[int]]
    table_width: int  # columns
    input_ids: list[int]
    positions: list[int]
    out_loc: list[int]
    truth: list[list[int]] | None
    truth_width: int
    truth_lens: list[int] | None
    lookup: list[int] | None

    @classmethod
    def read(cls, b: StepBatch) -> Batch:
        truth = None if b.truth is None else [[int(x) for x in row] for row in b.truth.tolist()]
        return cls(
            rows=ints(b.rows),
            prefix=ints(b.prefix_lens),
            extend=ints(b.extend_lens),
            table=[[int(x) for x in row] for row in b.table.tolist()],
            table_width=int(b.table.shape[1]),
            input_ids=ints(b.input_ids),
            positions=ints(b.positions),
            out_loc=ints(b.out_cache_loc),
            truth=truth,
            truth_width=0 if b.truth is None else int(b.truth.shape[1]),
            truth_lens=None if b.truth_lens is None else ints(b.truth_lens),
            lookup=None if b.lookup is None else ints(b.lookup),
        )


class Log:
    """The violation log as lists; appends one row at a time, as the docstring of ViolationLog says."""

    def __init__(self, log: ViolationLog) -> None:
        self.first = [[int(x) for x in row] for row in log.first.tolist()]
        self.last = [[int(x) for x in row] for row in log.last.tolist()]
        self.counters = ints(log.counters)
        self.k = len(self.first)

    def append(self, row: list[int]) -> None:
        i = self.counters[Counter.VIOLATIONS]  # lifetime index of this row
        if i < self.k:
            self.first[i] = list(row)
        self.last[i % self.k] = list(row)
        self.counters[Counter.VIOLATIONS] += 1
        for bit, reason in enumerate(REASONS):
            if row[Field.REASONS] & reason:
                self.counters[bit] += 1

    def write_back(self, log: ViolationLog) -> None:
        log.first.copy_(torch.tensor(self.first, dtype=torch.int64).reshape(log.first.shape))
        log.last.copy_(torch.tensor(self.last, dtype=torch.int64).reshape(log.last.shape))
        log.counters.copy_(torch.tensor(self.counters, dtype=torch.int64))


def violation_row(phase: Phase, group: CanaryGroup, **fields: int) -> list[int]:
    row = [0] * ROW_WIDTH
    row[Field.PHASE] = int(phase)
    row[Field.GROUP] = group.group_id
    row[Field.EXPECTED_TOKEN] = UNKNOWN_TOKEN
    for name, value in fields.items():
        row[Field[name]] = int(value)
    return row


# --------------------------------------------------------------------------- index resolution


def table_index(group: CanaryGroup, b: Batch, row: int, pos: int) -> int:
    """The table's entry for position ``pos`` of table row ``row`` (both in range), in int64."""
    page = group.page_size
    entry = b.table[row][pos // page]
    return i64(entry * page + pos % page)


def to_pool(b: Batch, index: int) -> tuple[int, bool]:
    """Translate a table-space index through the lookup; returns (slot, lookup index out of range)."""
    if b.lookup is None:
        return index, False
    if not 0 <= index < len(b.lookup):
        return -1, True
    return b.lookup[index], False


def expected_token(group: CanaryGroup, b: Batch, batch_row: int, pos: int) -> int:
    """Ground truth for KV position ``pos`` (a draft pool holds the token of ``pos + token_offset``)."""
    if b.truth is None or b.truth_lens is None:
        return UNKNOWN_TOKEN
    table_row = b.rows[batch_row]
    idx = pos + group.token_offset
    if not (0 <= idx < b.truth_lens[batch_row] and idx < b.truth_width and 0 <= table_row < len(b.truth)):
        return UNKNOWN_TOKEN
    return i32(b.truth[table_row][idx])  # tokens are int32 wherever they are stored
