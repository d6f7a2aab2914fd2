"""Deterministic random cases for plan -> verify -> stamp: one group, one step, clean or corrupted.

A case is built as a small world: requests with token sequences, slots allocated from the pool (in
pages when ``page_size > 1``; through a full->window lookup table for lookup groups), records filled by
actually running a few clean reference steps (so most verify entries pass), then the step under test.
With ``corrupt=True`` one to four random faults are applied to tables, lookup, records, batch values,
capacities or the log.  Everything is derived from one ``random.Random``, so a seed pins a case.

The world is drawn by :mod:`gen_world`, the faults by :mod:`gen_faults`.  Test modules import this as ``gen``
(pytest puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterable

import torch

from gen_faults import apply_fault
from gen_world import MAX_CONTEXT, MAX_ROWS, RawBatch, World, make_world, step_batch
from kvcanary.batch import StepBatch
from kvcanary.layout import CanaryGroup, RecordStore
from kvcanary.ops import reference as ref
from kvcanary.schema import NUM_COUNTERS, ROW_WIDTH, Counter
from kvcanary.workspace import Capacities, GroupState, PlanWorkspace, ViolationLog

JUNK = -7777  # fills workspace entries nobody wrote, so a kernel that skips a write is caught


@dataclasses.dataclass
class Case:
    group: CanaryGroup
    caps: Capacities
    batch: StepBatch
    records: RecordStore
    log: ViolationLog
    ws: PlanWorkspace
    seed: int = 0
    faults: tuple[str, ...] = ()

    def clone(self) -> Case:
        """Independent copies of every mutable input (records, log, workspace, batch tensors)."""
        clones = {k: (None if v is None else v.clone()) for k, v in self.batch.tensors().items()}
        batch = StepBatch(**clones)  # type: ignore[arg-type]
        ws = PlanWorkspace(**{f.name: getattr(self.ws, f.name).clone() for f in dataclasses.fields(self.ws)})
        return dataclasses.replace(self, batch=batch, records=self.records.clone(), log=self.log.clone(), ws=ws)

    def describe(self) -> str:
        g, b = self.group, self.batch
        return (
            f"seed={self.seed} kind={g.kind.value} window={g.window} lookup={g.uses_lookup} page={g.page_size} "
            f"offset={g.token_offset} reserved={g.reserved_slots} padding_row={g.padding_row} "
            f"B={b.batch_size} tokens={b.num_tokens} verify_cap={self.caps.verify_entries} "
            f"K={self.caps.log_rows} faults={list(self.faults)}"
        )


def run_reference(case: Case) -> Case:
    """plan, verify and stamp with the reference on a clone of ``case``; returns the clone."""
    out = case.clone()
    ref.plan(GroupState(out.group, out.records, out.ws, out.log), out.batch)
    ref.verify(GroupState(out.group, out.records, out.ws, out.log), out.batch, out.caps.verify_entries)
    ref.stamp(GroupState(out.group, out.records, out.ws, out.log), out.batch)
    return out


# --------------------------------------------------------------------------- the case


def _warm_up(rng: random.Random, world: World, records: RecordStore) -> None:
    """Stamp each request's prefix with one to three clean reference steps."""
    cursors = {id(r): 0 for r in world.requests}
    n_steps = rng.randint(1, 3)
    caps = Capacities(max_batch=MAX_ROWS + 4, max_tokens=MAX_ROWS * MAX_CONTEXT + 8, verify_entries=4096)
    ws = PlanWorkspace.allocate(caps, num_slots=records.num_slots)
    log = ViolationLog.allocate(4)
    for step in range(n_steps):
        chunks = []
        for r in world.requests:
            done = cursors[id(r)]
            left = r.prefix - done
            if left <= 0:
                continue
            n = left if step == n_steps - 1 else rng.randint(0, left)
            if n:
                chunks.append((r, done, n))
                cursors[id(r)] = done + n
        if not chunks:
            continue
        raw = step_batch(rng, world, chunks, padding_rows=0, with_truth=False)
        batch = raw.to_batch(rng)
        ref.plan(GroupState(world.group, records, ws, log), batch)
        ref.verify(GroupState(world.group, records, ws, log), batch, caps.verify_entries)
        ref.stamp(GroupState(world.group, records, ws, log), batch)
    if log.total():
        raise RuntimeError(f"warm-up is not clean: {log.rows().tolist()}")


def random_case(rng: random.Random | int, *, corrupt: bool) -> Case:
    """One random single-step case; ``corrupt`` applies one to four random faults."""
    seed = rng if isinstance(rng, int) else rng.randrange(2**32)
    r = random.Random(seed)
    world = make_world(r)
    group = world.group
    records = RecordStore.allocate(group.num_slots)
    _warm_up(r, world, records)

    live = [(req, req.prefix, req.extend) for req in world.requests]
    r.shuffle(live)
    n_pad = r.choice([0, 0, 1, 2]) if group.padding_row is not None else 0
    raw = step_batch(r, world, live, padding_rows=n_pad, with_truth=r.random() < 0.5)

    faults: list[str] = []
    small_verify = small_log = False
    if corrupt:
        for _ in range(r.randint(1, 4)):
            faults.append(apply_fault(r, world, raw, records))
        small_verify = r.random() < 0.25
        small_log = r.random() < 0.4
    elif r.random() < 0.1:
        small_verify = True  # overflow is not a corruption: verification is partial, the rest counted
    batch = raw.to_batch(r)

    b, n = batch.batch_size, batch.num_tokens
    total_verify = _total_verify_upper_bound(group, raw)
    verify_entries = r.randint(1, max(1, total_verify)) if small_verify else total_verify + r.randint(1, 16)
    max_context = len(raw.table[0]) * group.page_size
    need = min(group.window, max_context) if group.window > 0 else max_context
    if verify_entries < need:
        max_context = verify_entries  # declare a shorter context so the small capacity is legal
    caps = Capacities(
        max_batch=b + r.choice([0, 0, 1, 5]),
        max_tokens=max(n, 1) + r.choice([0, 0, 3, 17]),
        verify_entries=verify_entries,
        max_context=max_context,
        log_rows=r.choice([1, 2, 3]) if small_log else r.choice([8, 64]),
    )
    caps.check_covers(group.window)
    log = ViolationLog.allocate(caps.log_rows)
    if r.random() < 0.3:
        _prefill_log(r, log)
    ws = PlanWorkspace.allocate(caps, num_slots=group.num_slots)
    for t in (ws.verify_offsets, ws.write_offsets, ws.window_starts, ws.seed_links, ws.row_state):
        t.fill_(JUNK)
    # Marks left by earlier steps: stale ones (read marks only grow, so older ones are smaller) and, now and
    # then, the write marks' wrap point.
    ws.epoch.fill_(r.choice([0, r.randrange(1 << 40), PlanWorkspace.MARK_PERIOD - 1]))
    ws.read_marks.random_(-(2**31), 1, generator=torch.Generator().manual_seed(seed))
    ws.write_marks.random_(-(2**31), 2**31, generator=torch.Generator().manual_seed(seed + 1))
    return Case(group=group, caps=caps, batch=batch, records=records, log=log, ws=ws, seed=seed, faults=tuple(faults))


def _total_verify_upper_bound(group: CanaryGroup, raw: RawBatch) -> int:
    total = 0
    for row, p in zip(raw.rows, raw.prefix, strict=True):
        if group.padding_row is not None and row == group.padding_row:
            continue
        total += max(0, min(p, group.window) if group.window > 0 else p)
    return max(total, 1)


def _prefill_log(rng: random.Random, log: ViolationLog) -> None:
    """Earlier steps' violations: appends must continue the lifetime row count, not restart it."""
    k = log.capacity
    before = rng.randint(1, 3 * k)
    log.counters[Counter.VIOLATIONS] = before
    log.counters[: Counter.VIOLATIONS] = torch.tensor([rng.randint(0, before) for _ in range(Counter.VIOLATIONS)])
    for c in (Counter.VERIFIED, Counter.SKIPPED, Counter.STAMPED, Counter.CALLS):
        log.counters[c] = rng.randint(0, 1000)
    # Junk rows from values already drawn: the case's seed pins them, and the rng's later draws are unchanged.
    junk = torch.Generator().manual_seed(before * 7919 + int(log.counters[Counter.CALLS]))
    log.first.copy_(torch.randint(-1000, 1000, (k, ROW_WIDTH), generator=junk))
    log.last.copy_(torch.randint(-1000, 1000, (k, ROW_WIDTH), generator=junk))
    if int(log.counters.shape[0]) != NUM_COUNTERS:
        raise RuntimeError("counters layout changed")


# --------------------------------------------------------------------------- comparing outputs


def diff_outputs(a: Case, b: Case, *, skip_slots: Iterable[int] = ()) -> list[str]:
    """Every difference between two runs of the same case: records (except ``skip_slots``, e.g. slots
    written twice in one step, whose winner is unspecified), workspace prefixes and the whole log."""
    diffs: list[str] = []
    keep = torch.ones(a.records.num_slots, dtype=torch.bool)
    for s in skip_slots:
        if 0 <= s < a.records.num_slots:
            keep[s] = False
    for name in ("tokens", "positions", "links"):
        x, y = getattr(a.records, name), getattr(b.records, name)
        bad = ((x != y) & keep).nonzero().flatten().tolist()
        if bad:
            diffs.append(f"records.{name} differ at slots {bad[:8]}: {x[bad[:8]].tolist()} vs {y[bad[:8]].tolist()}")
    bs = a.batch.batch_size
    for name, n in (
        ("verify_offsets", bs + 1),
        ("write_offsets", bs + 1),
        ("window_starts", bs),
        ("seed_links", bs),
        ("row_state", bs),
    ):
        x, y = getattr(a.ws, name)[:n], getattr(b.ws, name)[:n]
        if not torch.equal(x, y):
            diffs.append(f"workspace.{name}[:{n}] differ: {x.tolist()} vs {y.tolist()}")
    for name in ("epoch", "read_marks", "write_marks"):  # the same-step marks, whole
        x, y = getattr(a.ws, name), getattr(b.ws, name)
        if not torch.equal(x, y):
            bad = (x != y).nonzero().flatten().tolist()
            diffs.append(f"workspace.{name} differ at {bad[:8]}: {x[bad[:8]].tolist()} vs {y[bad[:8]].tolist()}")
    for name in ("counters", "first", "last"):
        x, y = getattr(a.log, name), getattr(b.log, name)
        if not torch.equal(x, y):
            rows = (x != y).reshape(x.shape[0], -1).any(1).nonzero().flatten().tolist()
            diffs.append(f"log.{name} differ at {rows[:8]}: {x[rows[:4]].tolist()} vs {y[rows[:4]].tolist()}")
    return diffs
