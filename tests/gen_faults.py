"""The faults a corrupted random case (:mod:`gen`) applies to its step: tables, lookup, records, rows,
lengths, written tokens and the ground truth, one random family at a time."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

from gen_world import VOCAB, RawBatch, World, table_index
from kvcanary.layout import CanaryGroup, RecordStore

# --------------------------------------------------------------------------- corruptions


_KINDS = (
    "table_elsewhere", "table_negative", "table_huge", "table_reserved", "record_token", "record_position",
    "record_link", "record_cleared", "record_reserved", "row_out_of_range", "row_other_request", "bad_length",
    "position_off", "token_off", "out_loc_reserved", "out_loc_out_of_range", "out_loc_elsewhere",
)  # fmt: skip
_LOOKUP_KINDS = ("lookup_out_of_range", "lookup_elsewhere", "table_beyond_lookup")


@dataclasses.dataclass
class _Site:
    """What one fault may touch: the step's raw inputs and the records, with the draws' source."""

    rng: random.Random
    world: World
    raw: RawBatch
    records: RecordStore
    live: list[int]  # batch rows of requests (not the padding row)
    table_space: int  # table entries index this many slots (the lookup's length with a lookup)

    @property
    def group(self) -> CanaryGroup:
        return self.world.group

    def table_cell(self) -> tuple[int, int]:
        """Mostly a cell some request uses, so the fault is read this step."""
        rng, raw, page, n_rows = self.rng, self.raw, self.group.page_size, len(self.raw.table)
        if self.live and rng.random() < 0.85:
            b = rng.choice(self.live)
            row = raw.rows[b]
            length = raw.prefix[b] + raw.extend[b]
            if 0 <= row < n_rows and length > 0:
                return row, rng.randrange(min(len(raw.table[0]), -(-length // page)))
        return rng.randrange(n_rows), rng.randrange(len(raw.table[0]))


def apply_fault(rng: random.Random, world: World, raw: RawBatch, records: RecordStore) -> str:
    """Apply one random fault to the step's inputs; returns its name ("none" when it had nowhere to land)."""
    group = world.group
    live = [i for i, r in enumerate(raw.rows) if r != group.padding_row or group.padding_row is None]
    kinds = list(_KINDS) + (list(_LOOKUP_KINDS) if raw.lookup is not None else [])
    kinds += ["truth_off"] if raw.truth is not None else []
    kind = rng.choice(kinds)
    site = _Site(rng, world, raw, records, live, len(raw.lookup) if raw.lookup is not None else group.num_slots)
    family = next(f for prefixes, f in _FAMILIES if kind.startswith(prefixes))
    return kind if family(site, kind) else "none"


def _table_fault(site: _Site, kind: str) -> bool:
    rng, raw, page = site.rng, site.raw, site.group.page_size
    if kind == "table_reserved":
        return _table_reserved(site)
    r, c = site.table_cell()
    if kind == "table_elsewhere":
        raw.table[r][c] = rng.randrange(max(1, site.table_space // page))
    elif kind == "table_negative":
        raw.table[r][c] = rng.choice([-1, -2, -(2**31)])
    elif kind == "table_huge":
        raw.table[r][c] = rng.choice([site.table_space // page + rng.randint(0, 3), 2**31 - 1])
    else:  # table_beyond_lookup
        raw.table[r][c] = len(raw.lookup or []) // page + rng.randint(0, 2)
    return True


def _table_reserved(site: _Site) -> bool:
    """A live cell aimed at a reserved slot (its successor's predecessor is then reserved too)."""
    rng, raw, group, page = site.rng, site.raw, site.group, site.group.page_size
    if not group.reserved_slots:
        return False
    slot = rng.choice(group.reserved_slots)
    if raw.lookup is not None:
        hits = [i for i, s in enumerate(raw.lookup) if s == slot and i % page == 0]
        if not hits:
            return False
        slot = rng.choice(hits)
    r, c = site.table_cell()
    n_rows = len(raw.table)
    seeded = [b for b in site.live if raw.prefix[b] > 0 and raw.extend[b] > 0 and 0 <= raw.rows[b] < n_rows]
    if seeded and rng.random() < 0.4:  # the cell of a chain seed (position prefix - 1)
        b = rng.choice(seeded)
        r, c = raw.rows[b], min((raw.prefix[b] - 1) // page, len(raw.table[0]) - 1)
    raw.table[r][c] = slot // page
    if rng.random() < 0.5:
        junk_reserved(rng, group, site.records)
    return True


def _record_fault(site: _Site, kind: str) -> bool:
    rng, records = site.rng, site.records
    if kind == "record_reserved":  # junk in a reserved slot's record (a padding write mirrored by a block copy)
        if not site.group.reserved_slots:
            return False
        junk_reserved(rng, site.group, records)
        return True
    written = [int(s) for s in (records.links != 0).nonzero().flatten()]
    if not written:
        return False
    s = rng.choice(written)
    if kind == "record_token":
        records.tokens[s] = rng.randrange(VOCAB)
    elif kind == "record_position":
        records.positions[s] = int(records.positions[s]) + rng.choice([-1, 1, 7])
    elif kind == "record_link":
        records.links[s] = rng.randrange(-(2**63), 2**63)
    else:
        records.tokens[s], records.positions[s], records.links[s] = 0, 0, 0
    return True


def _lookup_fault(site: _Site, kind: str) -> bool:
    rng, world, n_slots = site.rng, site.world, site.group.num_slots
    lut = list(site.raw.lookup or [])
    # Prefer an entry the live requests reach.
    cand = [table_index(world, q.row, p) for q in world.requests for p in range(q.prefix + q.extend)]
    cand = [c for c in cand if 0 <= c < len(lut)] or list(range(len(lut)))
    i = rng.choice(cand)
    if kind == "lookup_out_of_range":
        lut[i] = rng.choice([-1, n_slots, n_slots + 5, 2**40])
    else:
        lut[i] = rng.randrange(n_slots)
    site.raw.lookup = lut
    return True


def _row_fault(site: _Site, kind: str) -> bool:
    rng, raw, n_rows = site.rng, site.raw, len(site.raw.table)
    if kind == "bad_length":
        _bad_length(site)
        return True
    if not site.live:
        return False
    if kind == "row_out_of_range":
        b = rng.choice(site.live)  # drawn before the value, as the cases were always drawn
        raw.rows[b] = rng.choice([-1, -3, n_rows, n_rows + 4])
    else:  # row_other_request (the value is evaluated, and drawn, before the row)
        raw.rows[rng.choice(site.live)] = rng.randrange(n_rows)
    return True


def _bad_length(site: _Site) -> None:
    rng, raw = site.rng, site.raw
    b = rng.randrange(len(raw.rows))
    width = len(raw.table[0]) * site.group.page_size
    what = rng.choice(["neg_prefix", "neg_extend", "too_long", "too_many_tokens"])
    if what == "neg_prefix":
        raw.prefix[b] = rng.choice([-1, -5])
    elif what == "neg_extend":
        raw.extend[b] = rng.choice([-1, -2])
    elif what == "too_long":
        raw.prefix[b] = width - raw.extend[b] + rng.randint(1, 3)
    else:
        raw.extend[b] += len(raw.input_ids) - sum(max(0, e) for e in raw.extend) + rng.randint(1, 3)


def _token_fault(site: _Site, kind: str) -> bool:
    """A fault on one written token: its position, id or write location."""
    rng, raw, group = site.rng, site.raw, site.group
    if not raw.input_ids:
        return False
    t = rng.randrange(len(raw.input_ids))
    if kind == "position_off":
        raw.positions[t] += rng.choice([-1, 1, 2])
    elif kind == "token_off":
        raw.input_ids[t] = (raw.input_ids[t] + rng.randint(1, 100)) % VOCAB
    elif kind == "out_loc_reserved":
        if not group.reserved_slots:
            return False
        slot = rng.choice(group.reserved_slots)
        if raw.lookup is not None:
            hits = [i for i, s in enumerate(raw.lookup) if s == slot]
            if not hits:
                return False
            slot = rng.choice(hits)
        raw.out_loc[t] = slot
    elif kind == "out_loc_out_of_range":
        raw.out_loc[t] = rng.choice([-1, site.table_space, site.table_space + 9])
    else:  # out_loc_elsewhere
        raw.out_loc[t] = rng.choice(raw.out_loc) if rng.random() < 0.5 else rng.randrange(site.table_space)
    return True


def _truth_fault(site: _Site, kind: str) -> bool:
    rng, raw = site.rng, site.raw
    truth = raw.truth or []
    if not site.live:
        return False
    row = raw.rows[rng.choice(site.live)]
    if not 0 <= row < len(truth):
        return False
    col = rng.randrange(len(truth[row]))
    truth[row][col] = (truth[row][col] + rng.randint(1, 100)) % VOCAB
    return True


# Each kind's family, by the prefixes of its name.
_FAMILIES: tuple[tuple[tuple[str, ...], Callable[[_Site, str], bool]], ...] = (
    (("table_",), _table_fault),
    (("record_",), _record_fault),
    (("lookup_",), _lookup_fault),
    (("row_", "bad_length"), _row_fault),
    (("position_off", "token_off", "out_loc_"), _token_fault),
    (("truth_off",), _truth_fault),
)


def junk_reserved(rng: random.Random, group: CanaryGroup, records: RecordStore) -> None:
    """Junk in every reserved slot's record (an engine's padding write mirrored by a block copy)."""
    for s in group.reserved_slots:
        records.tokens[s], records.positions[s] = rng.randrange(VOCAB), rng.randint(0, 50)
        records.links[s] = rng.randrange(-(2**63), 2**63) | 1
