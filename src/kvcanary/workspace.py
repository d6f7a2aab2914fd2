"""Static per-step buffers, sized once from declared capacities and never reallocated."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from kvcanary import hashing
from kvcanary.arguments import require_int
from kvcanary.layout import CanaryGroup, RecordStore
from kvcanary.schema import NUM_COUNTERS, ROW_WIDTH, Counter, Field


@dataclasses.dataclass(frozen=True)
class Capacities:
    """Upper bounds for one group's per-step work.

    ``max_batch`` rows and ``max_tokens`` written tokens per step are hard limits (a larger batch is
    refused before anything changes).  ``verify_entries`` bounds the verify entries checked per step;
    beyond it verification is partial and the remainder is counted as skipped.  ``max_context`` is
    the longest sequence the engine serves: verify_entries must cover at least one such prefix (or
    one window).  ``log_rows`` is K: the log keeps the first K and the last K violation rows.
    """

    max_batch: int
    max_tokens: int
    verify_entries: int
    max_context: int = 0
    log_rows: int = 64

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_tokens", "verify_entries", "max_context", "log_rows"):
            require_int(f"capacity {name}", getattr(self, name))
        for name in ("max_batch", "max_tokens", "verify_entries", "log_rows"):
            if getattr(self, name) <= 0:
                raise ValueError(f"capacity {name} must be positive, got {getattr(self, name)}")
        if self.max_context < 0:
            raise ValueError(f"max_context must be >= 0, got {self.max_context}")

    def check_covers(self, window: int) -> None:
        """Refuse a verify capacity that cannot hold even one request's prefix or window."""
        need = min(window, self.max_context) if window > 0 else self.max_context
        if self.verify_entries < need:
            raise ValueError(
                f"capacity verify_entries={self.verify_entries} is smaller than one request's verify "
                f"span {need} (max_context={self.max_context}, window={window})"
            )


@dataclasses.dataclass
class PlanWorkspace:
    """What plan leaves for verify and stamp, one entry per batch row (plus a total)."""

    verify_offsets: torch.Tensor  # int64 [B+1]: exclusive prefix sum of verify entries per row
    write_offsets: torch.Tensor  # int64 [B+1]: exclusive prefix sum of extend_lens per row
    window_starts: torch.Tensor  # int64 [B]: first verified position per row
    seed_links: torch.Tensor  # int64 [B]: link the row's first written token chains from
    row_state: torch.Tensor  # int32 [B]: ROW_ACTIVE / ROW_PADDING / ROW_BAD
    mult_powers: torch.Tensor  # int64 [max_tokens+1]: LINK_MULT**i, for the reference's scan
    inv_powers: torch.Tensor  # int64 [max_tokens+1]: LINK_MULT_INV**i
    # Same-step write checks (8 + 4 bytes a slot): plan bumps the epoch; verify keeps read_mark(epoch, row)
    # (the largest, i.e. the lowest reader row) on every slot it reads live and 2 * mark_of(epoch) (+ 1 when
    # several tokens write it) on every slot written; stamp compares.
    epoch: torch.Tensor  # int64 [1]: plan calls so far
    read_marks: torch.Tensor  # int64 [num_slots]: epoch << READER_BITS | (READER_LIMIT - 1 - batch row)
    write_marks: torch.Tensor  # int32 [num_slots]: 2 * mark of the last step that wrote it, + 1 if twice
    # Kernel scratch (the reference leaves it alone).  Work is cut into items: one block of one row's
    # verify entries or written tokens.  Sized for the smallest block, so any block size fits.
    verify_items: torch.Tensor  # int64 [B+1]: exclusive prefix sum of verify items per row
    write_items: torch.Tensor  # int64 [B+1]: exclusive prefix sum of stamp items per row
    verify_counts: torch.Tensor  # int32 [max verify items]: violations found per item
    stamp_counts: torch.Tensor  # int32 [max stamp items]
    stamp_sums: torch.Tensor  # int64 [max stamp items]: each item's sum of its link-scan terms
    stamp_flags: torch.Tensor  # int64 [max stamp items]: call epoch in which stamp_sums[i] was published
    sync: torch.Tensor  # int64 [8]: per phase (verify, stamp): pending violations, finished programs, epoch
    write_old_positions: torch.Tensor  # int32 [max_tokens]: window groups: the position each written slot held

    ROW_ACTIVE = 0
    ROW_PADDING = 1
    ROW_BAD = 2
    SCRATCH_BLOCK = 128  # smallest item size (entries or tokens) a kernel may use
    MARK_BYTES_PER_SLOT = 12  # read_marks (int64) + write_marks (int32)
    MARK_PERIOD = (1 << 30) - 1  # write marks use 1 + epoch % MARK_PERIOD: never 0, 2 * mark + 1 fits int32
    READER_BITS = 20  # read marks carry the reading batch row below the epoch
    READER_LIMIT = 1 << READER_BITS

    @staticmethod
    def read_mark(epoch: int, batch_row: int) -> int:
        return (epoch << PlanWorkspace.READER_BITS) | (PlanWorkspace.READER_LIMIT - 1 - batch_row)

    @staticmethod
    def mark_of(epoch: int) -> int:
        return 1 + epoch % PlanWorkspace.MARK_PERIOD

    @staticmethod
    def max_items(entries: int, max_batch: int) -> int:
        """Items covering ``entries`` in blocks of SCRATCH_BLOCK, each row adding at most one partial block."""
        return -(-entries // PlanWorkspace.SCRATCH_BLOCK) + max_batch

    @classmethod
    def allocate(cls, caps: Capacities, device: torch.device | str = "cpu", *, num_slots: int) -> PlanWorkspace:
        """Buffers for one group of ``num_slots`` slots (the same-step marks are per slot)."""
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        if caps.max_batch > cls.READER_LIMIT:
            raise ValueError(f"max_batch must be at most {cls.READER_LIMIT}, got {caps.max_batch}")
        b = caps.max_batch

        def i64(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int64, device=device)

        return cls(
            verify_offsets=i64(b + 1),
            write_offsets=i64(b + 1),
            window_starts=i64(b),
            seed_links=i64(b),
            row_state=torch.zeros(b, dtype=torch.int32, device=device),
            mult_powers=hashing.power_table(hashing.LINK_MULT, caps.max_tokens + 1, device),
            inv_powers=hashing.power_table(hashing.LINK_MULT_INV, caps.max_tokens + 1, device),
            epoch=i64(1),
            read_marks=torch.zeros(num_slots, dtype=torch.int64, device=device),
            write_marks=torch.zeros(num_slots, dtype=torch.int32, device=device),
            verify_items=i64(b + 1),
            write_items=i64(b + 1),
            verify_counts=torch.zeros(cls.max_items(caps.verify_entries, b), dtype=torch.int32, device=device),
            stamp_counts=torch.zeros(cls.max_items(caps.max_tokens, b), dtype=torch.int32, device=device),
            stamp_sums=i64(cls.max_items(caps.max_tokens, b)),
            stamp_flags=i64(cls.max_items(caps.max_tokens, b)),
            sync=i64(8),
            write_old_positions=torch.zeros(max(caps.max_tokens, 1), dtype=torch.int32, device=device),
        )


@dataclasses.dataclass
class ViolationLog:
    """Device-side violation log: the first K and the last K rows, counters and totals.

    Rows are appended in a deterministic order (plan rows by batch row, verify rows by entry,
    stamp rows by token), so the reference and the kernels produce the same log.  Row i of the
    log's lifetime goes to ``first[i]`` when i < K and always to ``last[i % K]``.
    """

    first: torch.Tensor  # int64 [K, ROW_WIDTH]
    last: torch.Tensor  # int64 [K, ROW_WIDTH]
    counters: torch.Tensor  # int64 [NUM_COUNTERS]

    @classmethod
    def allocate(cls, capacity: int, device: torch.device | str = "cpu") -> ViolationLog:
        if capacity <= 0:
            raise ValueError(f"log capacity must be positive, got {capacity}")
        return cls(
            first=torch.zeros(capacity, ROW_WIDTH, dtype=torch.int64, device=device),
            last=torch.zeros(capacity, ROW_WIDTH, dtype=torch.int64, device=device),
            counters=torch.zeros(NUM_COUNTERS, dtype=torch.int64, device=device),
        )

    @property
    def capacity(self) -> int:
        return int(self.first.shape[0])

    def clear(self) -> None:
        self.first.zero_()
        self.last.zero_()
        self.counters.zero_()

    def clone(self) -> ViolationLog:
        return ViolationLog(self.first.clone(), self.last.clone(), self.counters.clone())

    def total(self) -> int:
        return int(self.counters[Counter.VIOLATIONS])

    def rows(self) -> torch.Tensor:
        """The kept rows in log order (host copy): all of them when total <= 2K, else first K then last K."""
        total, k = self.total(), self.capacity
        first = self.first[: min(total, k)].to("cpu", copy=True)  # .cpu() aliases a CPU log: clear() would wipe it
        if total <= k:
            return first
        tail_start = max(k, total - k)
        idx = torch.arange(tail_start, total) % k
        return torch.cat([first, self.last.cpu()[idx]])

    def rows_with(self, field: Field, value: int) -> torch.Tensor:
        rows = self.rows()
        return rows[rows[:, field] == value]


class GroupState(NamedTuple):
    """What plan, verify and stamp work on besides the step's batch: the group, its records and plan
    workspace, and the log their violations go to (the reference and the kernels take it alike)."""

    group: CanaryGroup
    records: RecordStore
    ws: PlanWorkspace
    log: ViolationLog
