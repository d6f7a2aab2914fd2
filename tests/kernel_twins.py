"""Scripted multi-step cases for the kernels: a small engine (``World``) and a reference/kernel pair that
runs every step on both and compares everything (``Twin``), shared by the case, same-step and graph suites.
"""

from __future__ import annotations

import dataclasses
import random

import torch

from kernel_compare import DEVICE
from kvcanary import CanaryGroup, Capacities, GroupKind, StepBatch
from kvcanary.layout import RecordStore
from kvcanary.ops import launchers
from kvcanary.ops import reference as ref
from kvcanary.schema import Counter, Reason
from kvcanary.workspace import GroupState, PlanWorkspace, ViolationLog

# plan_verify fuses workspaces of up to fuse_max_batch rows (8 by default): the twins ask for 32, so that every
# other step runs the fused launch and the rest the two-launch path.
FUSING = launchers.KernelTuning(fuse_max_batch=32)
SMALL = launchers.KernelTuning(
    verify_block=128, stamp_block=128, carry_block=128, interpreter_programs=3, fuse_max_batch=32
)


# --------------------------------------------------------------------------- a scripted engine


@dataclasses.dataclass
class World:
    """Requests (table rows) with token sequences, slots handed out in shuffled pages."""

    group: CanaryGroup
    table: torch.Tensor  # int64 [n_rows, n_pages]: page ids (slots when page_size == 1)
    seqs: dict[int, list[int]]
    lookup: torch.Tensor | None = None

    @classmethod
    def make(cls, *, rows: int = 4, context: int = 64, page: int = 1, window: int = 0, lookup: bool = False,
             token_offset: int = 0, seed: int = 0) -> World:  # fmt: skip
        rng = random.Random(seed)
        pages_per_row = -(-context // page)
        n_pages = rows * pages_per_row + 2  # page 0 holds reserved slot 0
        ids = list(range(1, n_pages))
        rng.shuffle(ids)
        table = torch.zeros(rows + 1, pages_per_row, dtype=torch.int64)  # row 0: padding
        for r in range(1, rows + 1):
            table[r] = torch.tensor([ids.pop() for _ in range(pages_per_row)])
        num_slots = n_pages * page
        lut = None
        if lookup:  # full index -> window pool slot, a permutation keeping 0 on 0
            perm = list(range(1, num_slots))
            rng.shuffle(perm)
            lut = torch.tensor([0, *perm], dtype=torch.int64)
        group = CanaryGroup(
            num_slots=num_slots,
            kind=GroupKind.SLIDING_WINDOW if window else GroupKind.FULL,
            window=window,
            uses_lookup=lookup,
            page_size=page,
            token_offset=token_offset,
            reserved_slots=(0,),
            group_id=3,
        )
        seqs = {r: [rng.randrange(32_000) for _ in range(context + 1)] for r in range(1, rows + 1)}
        return cls(group, table, seqs, lut)

    def index(self, row: int, pos: int) -> int:
        page = self.group.page_size
        return int(self.table[row, pos // page]) * page + pos % page

    def batch(self, spans: list[tuple[int, int, int]], *, truth: bool = False, pad_rows: int = 0) -> StepBatch:
        """spans: (table row, prefix_len, extend_len); padding rows (row 0, nothing written) at the end."""
        off = self.group.token_offset
        ids, pos, loc = [], [], []
        for row, p, e in spans:
            for q in range(p, p + e):
                ids.append(self.seqs[row][q + off])
                pos.append(q)
                loc.append(self.index(row, q))
        spans = spans + [(0, 0, 0)] * pad_rows
        i64 = torch.int64
        b = StepBatch(
            rows=torch.tensor([s[0] for s in spans], dtype=torch.int32),
            prefix_lens=torch.tensor([s[1] for s in spans], dtype=torch.int32),
            extend_lens=torch.tensor([s[2] for s in spans], dtype=torch.int32),
            table=self.table.to(torch.int32).clone(),
            input_ids=torch.tensor(ids, dtype=i64),
            positions=torch.tensor(pos, dtype=i64),
            out_cache_loc=torch.tensor(loc, dtype=i64),
            lookup=None if self.lookup is None else self.lookup.clone(),
        )
        if truth:
            b.truth = torch.tensor([[0] * (len(self.seqs[1]))] + [self.seqs[r] for r in sorted(self.seqs)])
            b.truth_lens = torch.tensor([p + e + off for _, p, e in spans], dtype=torch.int32)
        return b


class Twin:
    """The reference on the CPU and the kernels on DEVICE, fed the same batches, compared after every phase."""

    def __init__(self, world: World, caps: Capacities, tuning: launchers.KernelTuning = FUSING):
        self.group, self.caps, self.tuning = world.group, caps, tuning
        self.ref = State.make(world.group, caps, torch.device("cpu"))
        self.dev = State.make(world.group, caps, DEVICE)
        self.steps = 0

    def step(self, batch: StepBatch) -> ViolationLog:
        """One step; returns the log of the step's violations (reference side)."""
        before = self.ref.log.total()
        dev_batch = batch.to(DEVICE)
        # Every other step runs plan and verify in one launch (GroupCanary.step's path), the others as two.
        self.steps += 1
        for phase in ("plan_verify", "stamp") if self.steps % 2 else ("plan", "verify", "stamp"):
            args = (self.caps.verify_entries,) if phase in ("verify", "plan_verify") else ()
            ref_phases = ("plan", "verify") if phase == "plan_verify" else (phase,)
            for p in ref_phases:
                p_args = (self.caps.verify_entries,) if p == "verify" else ()
                getattr(ref, p)(self.ref.of(self.group), batch, *p_args)
            getattr(launchers, phase)(self.dev.of(self.group), dev_batch, *args, tuning=self.tuning)
            self.ref.assert_equal(self.dev, batch.batch_size, phase)
        new = self.ref.log.clone()
        new.counters[Counter.VIOLATIONS] -= before
        return new


@dataclasses.dataclass
class State:
    records: RecordStore
    ws: PlanWorkspace
    log: ViolationLog

    @classmethod
    def make(cls, group: CanaryGroup, caps: Capacities, dev: torch.device) -> State:
        records = RecordStore.allocate(group.num_slots, dev)
        return cls(
            records,
            PlanWorkspace.allocate(caps, dev, num_slots=group.num_slots),
            ViolationLog.allocate(caps.log_rows, dev),
        )

    def of(self, group: CanaryGroup) -> GroupState:
        return GroupState(group, self.records, self.ws, self.log)

    def assert_equal(self, other: State, b: int, phase: str) -> None:
        pairs = {
            "records.tokens": (self.records.tokens, other.records.tokens),
            "records.positions": (self.records.positions, other.records.positions),
            "records.links": (self.records.links, other.records.links),
            "log.first": (self.log.first, other.log.first),
            "log.last": (self.log.last, other.log.last),
            "log.counters": (self.log.counters, other.log.counters),
        }
        for name in ("verify_offsets", "write_offsets"):
            pairs[f"ws.{name}"] = (getattr(self.ws, name)[: b + 1], getattr(other.ws, name)[: b + 1])
        for name in ("window_starts", "seed_links", "row_state"):
            pairs[f"ws.{name}"] = (getattr(self.ws, name)[:b], getattr(other.ws, name)[:b])
        for name in ("epoch", "read_marks", "write_marks"):
            pairs[f"ws.{name}"] = (getattr(self.ws, name), getattr(other.ws, name))
        for name, (x, y) in pairs.items():
            x, y = x.cpu(), y.cpu()
            assert torch.equal(x, y), f"after {phase}: {name} differs:\nreference {x.tolist()}\nkernels   {y.tolist()}"
        assert not torch.count_nonzero(other.ws.sync[launchers.SYNC_CLEAR]), (
            f"after {phase}: sync {other.ws.sync.tolist()}"
        )


def capacities(**kw: int) -> Capacities:
    base = {"max_batch": 8, "max_tokens": 256, "verify_entries": 1024, "max_context": 64, "log_rows": 8}
    return Capacities(**(base | kw))


def warm(world: World, twin: Twin, prefix: int) -> None:
    """Prefill every request to ``prefix`` in two chunks; must stay silent."""
    rows = sorted(world.seqs)
    half = prefix // 2
    for p, e in ((0, half), (half, prefix - half)):
        log = twin.step(world.batch([(r, p, e) for r in rows], truth=True))
        assert log.total() == 0, f"warm-up raised {log.rows().tolist()}"


def reason_count(twin: Twin, reason: Reason) -> int:
    return int(twin.ref.log.counters[reason.bit_length() - 1])
