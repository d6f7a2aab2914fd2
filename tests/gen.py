"""Deterministic random cases for plan -> verify -> stamp: one group, one step, clean or corrupted.

A case is built as a small world: requests with token sequences, slots allocated from the pool (in
pages when ``page_size > 1``; through a full->window lookup table for lookup groups), records filled by
actually running a few clean reference steps (so most verify entries pass), then the step under test.
With ``corrupt=True`` one to four random faults are applied to tables, lookup, records, batch values,
capacities or the log.  Everything is derived from one ``random.Random``, so a seed pins a case.

Test modules import this as ``gen`` (pytest puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterable

import torch

from kvcanary.batch import StepBatch
from kvcanary.layout import CanaryGroup, GroupKind, RecordStore
from kvcanary.ops import reference as ref
from kvcanary.schema import NUM_COUNTERS, ROW_WIDTH, Counter
from kvcanary.workspace import Capacities, GroupState, PlanWorkspace, ViolationLog

MAX_ROWS = 12  # live batch rows
MAX_STEP_TOKENS = 200
MAX_CONTEXT = 48
VOCAB = 50_000
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


# --------------------------------------------------------------------------- the world


@dataclasses.dataclass
class _Request:
    row: int  # table row
    seq: list[int]  # tokens; the stamped token at position p is seq[p + token_offset]
    prefix: int  # positions already in the cache at the step under test
    extend: int  # positions written by the step under test


@dataclasses.dataclass
class _World:
    group: CanaryGroup
    n_pages: int  # table width in pages
    table: list[list[int]]  # [n_rows][n_pages], entries in the table's index space
    lookup: list[int] | None  # full index -> pool slot
    requests: list[_Request]


def _make_group(rng: random.Random) -> tuple[CanaryGroup, int]:
    """A random group and the number of table-index pages it needs room for (decided later)."""
    page = rng.choice([1, 1, 1, 2, 3, 4, 8])
    sliding = rng.random() < 0.4
    window = rng.randint(1, 12) if sliding else 0
    uses_lookup = sliding and rng.random() < 0.6
    offset = rng.choice([0, 0, 1])
    padding_row: int | None = rng.choice([0, 0, None])
    group_id = rng.randint(0, 5)
    return (
        CanaryGroup(
            num_slots=1,  # replaced once the pool is sized
            group_id=group_id,
            name="swa" if sliding else "full",
            kind=GroupKind.SLIDING_WINDOW if sliding else GroupKind.FULL,
            window=window,
            uses_lookup=uses_lookup,
            page_size=page,
            token_offset=offset,
            reserved_slots=(),
            padding_row=padding_row,
            checks_new_reads=group_id != 5,  # derived, not drawn: the seeds keep their cases
        ),
        page,
    )


def _make_world(rng: random.Random) -> _World:
    proto, page = _make_group(rng)
    n_req = rng.choice([1, 1, 2, 3, 5, 7, 11, rng.randint(1, MAX_ROWS)])
    budget = MAX_STEP_TOKENS
    requests: list[_Request] = []
    first_row = 1 if proto.padding_row == 0 else 0
    n_rows = first_row + n_req + rng.randint(0, 2)  # spare rows hold stale junk
    rows = rng.sample(range(first_row, n_rows), n_req)
    for row in rows:
        kind = rng.choice(["decode", "decode", "prefill", "chunk", "idle"])
        if kind == "decode":
            prefix, extend = rng.randint(1, MAX_CONTEXT - 1), 1
        elif kind == "prefill":
            prefix, extend = 0, rng.randint(1, min(MAX_CONTEXT, max(1, budget)))
        elif kind == "chunk":
            prefix = rng.randint(1, MAX_CONTEXT - 2)
            extend = rng.randint(2, max(2, min(MAX_CONTEXT - prefix, budget)))
        else:
            prefix, extend = rng.randint(0, MAX_CONTEXT), 0
        extend = max(0, min(extend, budget))
        budget -= extend
        length = prefix + extend + proto.token_offset
        seq = [rng.randrange(VOCAB) for _ in range(length)]
        requests.append(_Request(row=row, seq=seq, prefix=prefix, extend=extend))

    longest = max([r.prefix + r.extend for r in requests] + [1])
    n_pages = -(-longest // page) + rng.randint(0, 2)
    pages_needed = sum(-(-(r.prefix + r.extend) // page) for r in requests)

    # Reserved slots sit in the group's pool; with page_size > 1 their pages are never handed out.
    n_reserved = rng.choice([0, 1, 1, 2, 3])
    spare_pages = rng.randint(1, 6)
    table = [[0] * n_pages for _ in range(n_rows)]
    lookup: list[int] | None = None
    if proto.uses_lookup:
        # Full index space: pages 1..; the lookup sends each used full index to a distinct pool slot.
        full_pages = pages_needed + spare_pages + 1
        page_ids = rng.sample(range(1, full_pages), pages_needed)
        n_used = pages_needed * page
        num_slots = n_used + n_reserved + rng.randint(1, 20)
        reserved = tuple(sorted(rng.sample(range(num_slots), n_reserved)))
        free = [s for s in range(num_slots) if s not in reserved]
        rng.shuffle(free)
        lookup = [rng.randrange(num_slots) for _ in range(full_pages * page + rng.randint(0, 3))]
        used_full = [p * page + o for p in page_ids for o in range(page)]
        for f, s in zip(used_full, free, strict=False):
            lookup[f] = s
    else:
        total_pages = pages_needed + spare_pages + n_reserved + 1
        num_slots = total_pages * page + rng.randint(0, page - 1)
        reserved_pages = rng.sample(range(total_pages), n_reserved)
        reserved = tuple(sorted({p * page + rng.randrange(page) for p in reserved_pages}))
        page_ids = rng.sample([p for p in range(total_pages) if p not in reserved_pages], pages_needed)
    it = iter(page_ids)
    used: set[tuple[int, int]] = set()
    for r in requests:
        for p in range(-(-(r.prefix + r.extend) // page)):
            table[r.row][p] = next(it)
            used.add((r.row, p))
    space = len(lookup) if lookup is not None else num_slots
    for row in range(n_rows):  # stale entries of cells nobody uses: mostly 0, some junk
        for p in range(n_pages):
            if (row, p) not in used and rng.random() < 0.2:
                table[row][p] = rng.randrange(max(1, space // page))
    group = dataclasses.replace(proto, num_slots=num_slots, reserved_slots=reserved)
    return _World(group=group, n_pages=n_pages, table=table, lookup=lookup, requests=requests)


def _table_index(world: _World, row: int, pos: int) -> int:
    page = world.group.page_size
    return world.table[row][pos // page] * page + pos % page


# --------------------------------------------------------------------------- tensors


def _fits_int32(values: list[int]) -> bool:
    return all(-(2**31) <= v < 2**31 for v in values)


@dataclasses.dataclass
class _RawBatch:
    """The batch as Python lists, so corruptions can edit it before it becomes tensors."""

    rows: list[int]
    prefix: list[int]
    extend: list[int]
    table: list[list[int]]
    input_ids: list[int]
    positions: list[int]
    out_loc: list[int]
    truth: list[list[int]] | None
    truth_lens: list[int] | None
    lookup: list[int] | None

    def to_batch(self, rng: random.Random) -> StepBatch:
        def t1(values: list[int]) -> torch.Tensor:
            dtype = rng.choice([torch.int32, torch.int64]) if _fits_int32(values) else torch.int64
            return torch.tensor(values, dtype=dtype).reshape(-1)

        def t2(values: list[list[int]], width: int) -> torch.Tensor:
            flat = [v for row in values for v in row]
            dtype = rng.choice([torch.int32, torch.int64]) if _fits_int32(flat) else torch.int64
            return torch.tensor(flat, dtype=dtype).reshape(len(values), width)

        return StepBatch(
            rows=t1(self.rows),
            prefix_lens=t1(self.prefix),
            extend_lens=t1(self.extend),
            table=t2(self.table, len(self.table[0]) if self.table else 0),
            input_ids=t1(self.input_ids),
            positions=t1(self.positions),
            out_cache_loc=t1(self.out_loc),
            truth=None if self.truth is None else t2(self.truth, len(self.truth[0]) if self.truth else 0),
            truth_lens=None if self.truth_lens is None else t1(self.truth_lens),
            lookup=None if self.lookup is None else t1(self.lookup),
        )


def _step_batch(
    rng: random.Random,
    world: _World,
    chunks: list[tuple[_Request, int, int]],
    *,
    padding_rows: int,
    with_truth: bool,
) -> _RawBatch:
    """A batch writing positions [prefix, prefix + extend) of each listed request, plus padding rows."""
    group = world.group
    off = group.token_offset
    entries: list[tuple[_Request | None, int, int]] = [(req, p, e) for req, p, e in chunks]
    for _ in range(padding_rows):
        entries.insert(rng.randint(0, len(entries)), (None, 0, 0))
    raw = _RawBatch([], [], [], [list(r) for r in world.table], [], [], [], None, None, world.lookup)
    for req, p, e in entries:
        if req is None:
            # Padding rows: sglang's row 0 with zero lengths; sometimes junk lengths and tokens.
            pad_row = group.padding_row if group.padding_row is not None else 0
            pe = rng.choice([0, 0, 0, 1, 2])
            raw.rows.append(pad_row)
            raw.prefix.append(rng.choice([0, 0, rng.randint(0, 5)]))
            raw.extend.append(pe)
            for _ in range(pe):
                raw.input_ids.append(rng.randrange(VOCAB))
                raw.positions.append(rng.randint(0, 5))
                raw.out_loc.append(rng.randrange(group.num_slots))
            continue
        raw.rows.append(req.row)
        raw.prefix.append(p)
        raw.extend.append(e)
        for pos in range(p, p + e):
            raw.input_ids.append(req.seq[pos + off])
            raw.positions.append(pos)
            raw.out_loc.append(_table_index(world, req.row, pos))
    for _ in range(rng.choice([0, 0, 0, 1, 3])):  # graph-padding tokens past the last row's
        raw.input_ids.append(0)
        raw.positions.append(0)
        raw.out_loc.append(0)
    if with_truth:
        n_rows = len(world.table)
        width = world.n_pages * group.page_size + off + rng.choice([0, 0, 1, 3, -1])
        width = max(width, 1)
        truth = [[rng.randrange(VOCAB) for _ in range(width)] for _ in range(n_rows)]
        for req in world.requests:
            for i, tok in enumerate(req.seq[:width]):
                truth[req.row][i] = tok
        lens: list[int] = []
        for req, p, e in entries:
            full = p + e + off
            lens.append(rng.choice([full, full, full, rng.randint(0, full + 2)]) if req is not None else 0)
        raw.truth, raw.truth_lens = truth, lens
    return raw


# --------------------------------------------------------------------------- corruptions


def _corrupt(rng: random.Random, world: _World, raw: _RawBatch, records: RecordStore) -> str:
    """Apply one random fault to the step's inputs; returns its name."""
    group = world.group
    n_slots = group.num_slots
    page = group.page_size
    n_rows = len(raw.table)
    live = [i for i, r in enumerate(raw.rows) if r != group.padding_row or group.padding_row is None]
    written = [int(s) for s in (records.links != 0).nonzero().flatten()]
    kinds = [
        "table_elsewhere",
        "table_negative",
        "table_huge",
        "table_reserved",
        "record_token",
        "record_position",
        "record_link",
        "record_cleared",
        "record_reserved",
        "row_out_of_range",
        "row_other_request",
        "bad_length",
        "position_off",
        "token_off",
        "out_loc_reserved",
        "out_loc_out_of_range",
        "out_loc_elsewhere",
    ]
    if raw.lookup is not None:
        kinds += ["lookup_out_of_range", "lookup_elsewhere", "table_beyond_lookup"]
    if raw.truth is not None:
        kinds += ["truth_off"]
    kind = rng.choice(kinds)
    table_space = len(raw.lookup) if raw.lookup is not None else n_slots

    def table_cell() -> tuple[int, int]:
        # Mostly a cell some request uses, so the fault is read this step.
        if live and rng.random() < 0.85:
            b = rng.choice(live)
            row = raw.rows[b]
            length = raw.prefix[b] + raw.extend[b]
            if 0 <= row < n_rows and length > 0:
                return row, rng.randrange(min(len(raw.table[0]), -(-length // page)))
        return rng.randrange(n_rows), rng.randrange(len(raw.table[0]))

    if kind == "table_elsewhere":
        r, c = table_cell()
        raw.table[r][c] = rng.randrange(max(1, table_space // page))
    elif kind == "table_negative":
        r, c = table_cell()
        raw.table[r][c] = rng.choice([-1, -2, -(2**31)])
    elif kind == "table_huge":
        r, c = table_cell()
        raw.table[r][c] = rng.choice([table_space // page + rng.randint(0, 3), 2**31 - 1])
    elif kind == "table_reserved":
        # A live cell aimed at a reserved slot (its successor's predecessor is then reserved too).
        if not group.reserved_slots:
            return "none"
        slot = rng.choice(group.reserved_slots)
        if raw.lookup is not None:
            hits = [i for i, s in enumerate(raw.lookup) if s == slot and i % page == 0]
            if not hits:
                return "none"
            slot = rng.choice(hits)
        r, c = table_cell()
        seeded = [b for b in live if raw.prefix[b] > 0 and raw.extend[b] > 0 and 0 <= raw.rows[b] < n_rows]
        if seeded and rng.random() < 0.4:  # the cell of a chain seed (position prefix - 1)
            b = rng.choice(seeded)
            r, c = raw.rows[b], min((raw.prefix[b] - 1) // page, len(raw.table[0]) - 1)
        raw.table[r][c] = slot // page
        if rng.random() < 0.5:
            _junk_reserved(rng, group, records)
    elif kind == "record_reserved":
        # Junk in a reserved slot's record (an engine's padding write mirrored by a block copy).
        if not group.reserved_slots:
            return "none"
        _junk_reserved(rng, group, records)
    elif kind == "table_beyond_lookup":
        r, c = table_cell()
        raw.table[r][c] = len(raw.lookup or []) // page + rng.randint(0, 2)
    elif kind in ("lookup_out_of_range", "lookup_elsewhere"):
        lut = list(raw.lookup or [])
        # Prefer an entry the live requests reach.
        cand = [_table_index(world, q.row, p) for q in world.requests for p in range(q.prefix + q.extend)]
        cand = [c for c in cand if 0 <= c < len(lut)] or list(range(len(lut)))
        i = rng.choice(cand)
        if kind == "lookup_out_of_range":
            lut[i] = rng.choice([-1, n_slots, n_slots + 5, 2**40])
        else:
            lut[i] = rng.randrange(n_slots)
        raw.lookup = lut
    elif kind.startswith("record_"):
        if not written:
            return "none"
        s = rng.choice(written)
        if kind == "record_token":
            records.tokens[s] = rng.randrange(VOCAB)
        elif kind == "record_position":
            records.positions[s] = int(records.positions[s]) + rng.choice([-1, 1, 7])
        elif kind == "record_link":
            records.links[s] = rng.randrange(-(2**63), 2**63)
        else:
            records.tokens[s], records.positions[s], records.links[s] = 0, 0, 0
    elif kind == "row_out_of_range":
        if not live:
            return "none"
        b = rng.choice(live)
        raw.rows[b] = rng.choice([-1, -3, n_rows, n_rows + 4])
    elif kind == "row_other_request":
        if not live:
            return "none"
        raw.rows[rng.choice(live)] = rng.randrange(n_rows)
    elif kind == "bad_length":
        b = rng.randrange(len(raw.rows))
        width = len(raw.table[0]) * page
        what = rng.choice(["neg_prefix", "neg_extend", "too_long", "too_many_tokens"])
        if what == "neg_prefix":
            raw.prefix[b] = rng.choice([-1, -5])
        elif what == "neg_extend":
            raw.extend[b] = rng.choice([-1, -2])
        elif what == "too_long":
            raw.prefix[b] = width - raw.extend[b] + rng.randint(1, 3)
        else:
            raw.extend[b] += len(raw.input_ids) - sum(max(0, e) for e in raw.extend) + rng.randint(1, 3)
    elif kind in ("position_off", "token_off", "out_loc_reserved", "out_loc_out_of_range", "out_loc_elsewhere"):
        if not raw.input_ids:
            return "none"
        t = rng.randrange(len(raw.input_ids))
        if kind == "position_off":
            raw.positions[t] += rng.choice([-1, 1, 2])
        elif kind == "token_off":
            raw.input_ids[t] = (raw.input_ids[t] + rng.randint(1, 100)) % VOCAB
        elif kind == "out_loc_reserved":
            if not group.reserved_slots:
                return "none"
            slot = rng.choice(group.reserved_slots)
            if raw.lookup is not None:
                hits = [i for i, s in enumerate(raw.lookup) if s == slot]
                if not hits:
                    return "none"
                slot = rng.choice(hits)
            raw.out_loc[t] = slot
        elif kind == "out_loc_out_of_range":
            raw.out_loc[t] = rng.choice([-1, table_space, table_space + 9])
        else:
            raw.out_loc[t] = rng.choice(raw.out_loc) if rng.random() < 0.5 else rng.randrange(table_space)
    elif kind == "truth_off":
        truth = raw.truth or []
        if not live:
            return "none"
        b = rng.choice(live)
        row = raw.rows[b]
        if not 0 <= row < len(truth):
            return "none"
        col = rng.randrange(len(truth[row]))
        truth[row][col] = (truth[row][col] + rng.randint(1, 100)) % VOCAB
    return kind


def _junk_reserved(rng: random.Random, group: CanaryGroup, records: RecordStore) -> None:
    """Junk in every reserved slot's record (an engine's padding write mirrored by a block copy)."""
    for s in group.reserved_slots:
        records.tokens[s], records.positions[s] = rng.randrange(VOCAB), rng.randint(0, 50)
        records.links[s] = rng.randrange(-(2**63), 2**63) | 1


# --------------------------------------------------------------------------- the case


def _warm_up(rng: random.Random, world: _World, records: RecordStore) -> None:
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
        raw = _step_batch(rng, world, chunks, padding_rows=0, with_truth=False)
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
    world = _make_world(r)
    group = world.group
    records = RecordStore.allocate(group.num_slots)
    _warm_up(r, world, records)

    live = [(req, req.prefix, req.extend) for req in world.requests]
    r.shuffle(live)
    n_pad = r.choice([0, 0, 1, 2]) if group.padding_row is not None else 0
    raw = _step_batch(r, world, live, padding_rows=n_pad, with_truth=r.random() < 0.5)

    faults: list[str] = []
    small_verify = small_log = False
    if corrupt:
        for _ in range(r.randint(1, 4)):
            faults.append(_corrupt(r, world, raw, records))
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


def _total_verify_upper_bound(group: CanaryGroup, raw: _RawBatch) -> int:
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
    log.first.copy_(torch.randint(-1000, 1000, (k, ROW_WIDTH)))
    log.last.copy_(torch.randint(-1000, 1000, (k, ROW_WIDTH)))
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
