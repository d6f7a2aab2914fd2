"""The world a random case is drawn from (:mod:`gen`): a group, requests with token sequences and their
slots, and the step's raw batch values before they become tensors."""

from __future__ import annotations

import dataclasses
import random

import torch

from kvcanary.batch import StepBatch
from kvcanary.layout import CanaryGroup, GroupKind

MAX_ROWS = 12  # live batch rows
MAX_STEP_TOKENS = 200
MAX_CONTEXT = 48
VOCAB = 50_000


# --------------------------------------------------------------------------- the world


@dataclasses.dataclass
class Request:
    row: int  # table row
    seq: list[int]  # tokens; the stamped token at position p is seq[p + token_offset]
    prefix: int  # positions already in the cache at the step under test
    extend: int  # positions written by the step under test


@dataclasses.dataclass
class World:
    group: CanaryGroup
    n_pages: int  # table width in pages
    table: list[list[int]]  # [n_rows][n_pages], entries in the table's index space
    lookup: list[int] | None  # full index -> pool slot
    requests: list[Request]


def make_group(rng: random.Random) -> tuple[CanaryGroup, int]:
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


def _draw_requests(rng: random.Random, proto: CanaryGroup, rows: list[int]) -> list[Request]:
    """One request per table row: decode, prefill, a chunk or idle, within the step's token budget."""
    budget = MAX_STEP_TOKENS
    requests: list[Request] = []
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
        requests.append(Request(row=row, seq=seq, prefix=prefix, extend=extend))
    return requests


def make_world(rng: random.Random) -> World:
    proto, page = make_group(rng)
    n_req = rng.choice([1, 1, 2, 3, 5, 7, 11, rng.randint(1, MAX_ROWS)])
    first_row = 1 if proto.padding_row == 0 else 0
    n_rows = first_row + n_req + rng.randint(0, 2)  # spare rows hold stale junk
    rows = rng.sample(range(first_row, n_rows), n_req)
    requests = _draw_requests(rng, proto, rows)

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
    return World(group=group, n_pages=n_pages, table=table, lookup=lookup, requests=requests)


def table_index(world: World, row: int, pos: int) -> int:
    page = world.group.page_size
    return world.table[row][pos // page] * page + pos % page


# --------------------------------------------------------------------------- tensors


def fits_int32(values: list[int]) -> bool:
    return all(-(2**31) <= v < 2**31 for v in values)


@dataclasses.dataclass
class RawBatch:
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
            dtype = rng.choice([torch.int32, torch.int64]) if fits_int32(values) else torch.int64
            return torch.tensor(values, dtype=dtype).reshape(-1)

        def t2(values: list[list[int]], width: int) -> torch.Tensor:
            flat = [v for row in values for v in row]
            dtype = rng.choice([torch.int32, torch.int64]) if fits_int32(flat) else torch.int64
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


def step_batch(
    rng: random.Random,
    world: World,
    chunks: list[tuple[Request, int, int]],
    *,
    padding_rows: int,
    with_truth: bool,
) -> RawBatch:
    """A batch writing positions [prefix, prefix + extend) of each listed request, plus padding rows."""
    group = world.group
    off = group.token_offset
    entries: list[tuple[Request | None, int, int]] = [(req, p, e) for req, p, e in chunks]
    for _ in range(padding_rows):
        entries.insert(rng.randint(0, len(entries)), (None, 0, 0))
    raw = RawBatch([], [], [], [list(r) for r in world.table], [], [], [], None, None, world.lookup)
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
            raw.out_loc.append(table_index(world, req.row, pos))
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
