"""Multi-step pipeline: a scripted engine drives plan -> verify -> stamp on a full and a window group.

The clean workload must stay silent while exercising every feature (chunked prefill, decode, a
shared prefix read by two requests, freed slots reused, window slots recycled).  Each fault edits
the engine's own state at one step and must be caught at exactly the step it first affects, with
the right reason, slot and rows, and nothing reported before.  A fault on the write side (the
allocator, out_cache_loc, a lost stamp) lands during step k's forward, after that step's verify, so
the first read it affects is step k + 1's verify.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from kvcanary import Capacities, Counter, Field, GroupCanary, Phase, Reason
from kvcanary.ops import Backend
from kvcanary.schema import NOT_STORED
from scripted_engine import EngineStep, Owner, ScriptedEngine, SlotPool, standard_workload

GROUPS = ("full", "window")
WITH_TRUTH = pytest.mark.parametrize("with_truth", [False, True], ids=["no-truth", "truth"])


@dataclasses.dataclass
class Run:
    engine: ScriptedEngine
    steps: list[EngineStep]
    reports: list[dict[str, torch.Tensor]]  # per step, per group: the violation rows of that step
    counters: dict[str, torch.Tensor]  # per group, summed over the run
    tokens_written: int  # real (non-padding) tokens the engine wrote


def run_workload(engine: ScriptedEngine, with_truth: bool) -> Run:
    full_group, window_group = engine.canary_groups()
    caps = Capacities(max_batch=8, max_tokens=32, verify_entries=128, max_context=24, log_rows=128)
    canaries = {
        "full": GroupCanary(full_group, caps, backend=Backend.REFERENCE),
        "window": GroupCanary(window_group, caps, backend=Backend.REFERENCE),
    }
    logs = {name: c.new_log() for name, c in canaries.items()}
    counters = {name: torch.zeros_like(log.counters) for name, log in logs.items()}
    steps: list[EngineStep] = []
    reports: list[dict[str, torch.Tensor]] = []
    tokens = 0
    while not engine.done:
        step = engine.begin_step()
        batches = {"full": step.full(with_truth), "window": step.window(with_truth)}
        report = {}
        for name, canary in canaries.items():
            logs[name].clear()
            canary.step(batches[name], logs[name])
            report[name] = logs[name].rows()
            counters[name] += logs[name].counters
        tokens += sum(int(n) for n, rid in zip(step.extend_lens, step.rids, strict=True) if rid is not None)
        engine.end_step()
        steps.append(step)
        reports.append(report)
    return Run(engine, steps, reports, counters, tokens)


# --------------------------------------------------------------------------- the clean run


@WITH_TRUTH
def test_clean_workload_is_silent_and_exercises_every_feature(with_truth: bool) -> None:
    run = run_workload(ScriptedEngine(standard_workload()), with_truth)
    noisy = [(k, g) for k, rep in enumerate(run.reports) for g in GROUPS if rep[g].shape[0]]
    assert noisy == []
    for g in GROUPS:
        c = run.counters[g]
        assert int(c[Counter.VIOLATIONS]) == 0
        assert int(c[Counter.SKIPPED]) == 0
        assert int(c[Counter.VERIFIED]) > 0
        assert int(c[Counter.STAMPED]) == run.tokens_written  # padding rows stamp nothing
    # The window group verifies fewer entries than the full group: it really slides.
    assert int(run.counters["window"][Counter.VERIFIED]) < int(run.counters["full"][Counter.VERIFIED])

    e = run.engine
    assert e.stats.shared_slots > 0
    assert e.stats.shared_reads > 0  # shared slots in the prefix of two batch rows of one step
    assert e.full_pool.reused > 0  # slots of finished requests handed to new ones
    assert e.window_pool.reused > 0  # window slots recycled as windows slide
    assert e.stats.window_released > 0
    assert e.stats.chunk_continuations > 0
    assert e.stats.decode_rows > 0
    assert e.stats.padding_rows > 0
    assert len(run.steps) == 15
    assert e.finished == [3, 1, 2, 4, 5]


def test_engine_bookkeeping_balances() -> None:
    """The engine itself is sound: every slot and lookup entry comes back once everything finished."""
    run = run_workload(ScriptedEngine(standard_workload()), with_truth=False)
    e = run.engine
    for pool in (e.full_pool, e.window_pool):
        assert pool.double_frees == 0
        assert not any(pool.refs)
        assert sorted(pool.free) == list(range(1, len(pool.refs)))
    assert not bool(e.full_to_window.any())
    assert e.request(4).row == e.request(3).row  # the table row of a finished request is reused


# --------------------------------------------------------------------------- faults


@dataclasses.dataclass(frozen=True)
class Catch:
    """The first violation row one group must report at the detection step."""

    rid: int  # the request whose batch row and table row the report names
    phase: Phase
    reasons: int
    slot: int
    position: int  # EXPECTED_POSITION
    pred: int | None = None


@dataclasses.dataclass
class Expected:
    """Filled in by the fault's hooks when they run (slots are only known then)."""

    step: int | None = None
    catches: dict[str, Catch] = dataclasses.field(default_factory=dict)
    victims: set[int] = dataclasses.field(default_factory=set)  # rids any report at that step may name


def foreign_record(stored: Owner, expected: Owner, with_truth: bool) -> int:
    """Reasons for reading a record written for ``stored`` where ``expected`` should be (other chain)."""
    reasons = Reason.LINK_MISMATCH
    if stored.pos != expected.pos:
        reasons |= Reason.POSITION_MISMATCH
    if with_truth and stored.token != expected.token:
        reasons |= Reason.TOKEN_MISMATCH
    return int(reasons)


def lost_write(pool: SlotPool, slot: int, expected: Owner, with_truth: bool) -> int:
    """A slot whose write was lost holds nothing (fresh) or its previous owner's stale record."""
    prev = pool.previous_owner(slot)
    return int(Reason.NEVER_WRITTEN) if prev is None else foreign_record(prev, expected, with_truth)


Fault = Callable[[ScriptedEngine, bool], Expected]


def table_entry_points_at_other_request(engine: ScriptedEngine, with_truth: bool) -> Expected:
    """Step 6: request 2's entry at position 5 points at request 1's slot for position 5.  Same
    position, so only the chain (and the token, when known) can tell; outside request 2's window."""
    exp = Expected()

    def hook(e: ScriptedEngine, step: EngineStep) -> None:
        stolen = e.slot_at(1, 5)
        e.req_to_token[e.request(2).row, 5] = stolen
        reasons = foreign_record(e.owner(1, 5), e.owner(2, 5), with_truth)
        exp.step, exp.victims = step.index, {2}
        exp.catches["full"] = Catch(2, Phase.VERIFY, reasons, stolen, 5)

    engine.before_forward(6, hook)
    return exp


def allocator_reuses_live_slot(engine: ScriptedEngine, with_truth: bool) -> Expected:
    """Step 4: the allocator hands out request 2's slot of position 3 while request 2 still holds it.
    Request 1's decode token overwrites it in step 4, while request 2 reads it: caught by that write's
    stamp (write_into_live_slot, naming request 2, whose read it hits)."""
    exp = Expected()
    victim: dict[str, int] = {}

    def alloc_hook(e: ScriptedEngine) -> None:
        victim["slot"] = e.slot_at(2, 3)
        assert e.full_pool.refs[victim["slot"]] == 1  # still referenced by request 2
        e.full_pool.force_next(victim["slot"])

    def forward_hook(e: ScriptedEngine, step: EngineStep) -> None:
        slot = victim["slot"]
        writer = e.full_pool.history[slot][-1]
        assert int(step.out_cache_loc[step.token_index(writer.rid)]) == slot  # the fault happened
        assert writer.rid != 2
        exp.step, exp.victims = step.index, {2}
        pos = int(step.positions[step.token_index(writer.rid)])
        exp.catches["full"] = Catch(2, Phase.STAMP, int(Reason.WRITE_INTO_LIVE_SLOT), slot, pos)

    engine.before_alloc(4, alloc_hook)
    engine.before_forward(4, forward_hook)
    return exp


def positions_off_by_one_at_chunk_boundary(engine: ScriptedEngine, with_truth: bool) -> Expected:
    """Step 9: request 4's second prefill chunk (prefix 3) is handed positions 4..6 instead of 3..5."""
    exp = Expected()

    def hook(e: ScriptedEngine, step: EngineStep) -> None:
        r = step.batch_row(4)
        assert int(step.prefix_lens[r]) == 3 and int(step.extend_lens[r]) == 3  # a chunk boundary
        t0 = step.token_index(4)
        step.positions[t0 : t0 + 3] += 1
        exp.step, exp.victims = step.index, {4}
        why = int(Reason.WRITE_POSITION_MISMATCH)
        exp.catches["full"] = Catch(4, Phase.STAMP, why, e.slot_at(4, 3), 3)
        exp.catches["window"] = Catch(4, Phase.STAMP, why, e.window_slot_at(4, 3), 3)

    engine.before_forward(9, hook)
    return exp


def table_entries_of_two_requests_swapped(engine: ScriptedEngine, with_truth: bool) -> Expected:
    """Step 7: requests 1 and 2 swap their table entries for position 6 (outside both windows)."""
    exp = Expected()

    def hook(e: ScriptedEngine, step: EngineStep) -> None:
        a, b = e.request(1).row, e.request(2).row
        sa, sb = e.slot_at(1, 6), e.slot_at(2, 6)
        e.req_to_token[a, 6], e.req_to_token[b, 6] = sb, sa
        exp.step, exp.victims = step.index, {1, 2}
        exp.catches["full"] = Catch(1, Phase.VERIFY, foreign_record(e.owner(2, 6), e.owner(1, 6), with_truth), sb, 6)

    engine.before_forward(7, hook)
    return exp


def writes_of_two_requests_swapped(engine: ScriptedEngine, with_truth: bool) -> Expected:
    """Step 3: requests 1 and 2 decode into each other's new slot (out_cache_loc swapped; the table
    keeps the right owners).  Caught at step 3 in both groups: each new token's own table entry leads to
    another slot than the one it writes (new_read_mismatch); both would read the other's record at step 4."""
    exp = Expected()

    def hook(e: ScriptedEngine, step: EngineStep) -> None:
        ta, tb = step.token_index(1), step.token_index(2)
        loc = step.out_cache_loc
        loc[ta], loc[tb] = loc[tb].clone(), loc[ta].clone()
        pa, pb = int(step.positions[ta]), int(step.positions[tb])
        reasons = int(Reason.NEW_READ_MISMATCH)
        exp.step, exp.victims = step.index, {1, 2}
        exp.catches["full"] = Catch(1, Phase.STAMP, reasons, e.slot_at(2, pb), pa)
        exp.catches["window"] = Catch(1, Phase.STAMP, reasons, e.window_slot_at(2, pb), pa)

    engine.before_forward(3, hook)
    return exp


def dropped_write(rid: int, at: int, token: int, how: str, fresh: bool) -> Fault:
    """Request ``rid``'s ``token``-th token of step ``at`` is never written.  ``how`` is "not-stored":
    the engine's own out_cache_loc says NOT_STORED (so the KV write is skipped too); or
    "stamp-skipped": the token is missing from the canary's view.  Either way the slot keeps what
    it held (nothing when fresh, a stale record when reused), first read at the next step."""

    def install(engine: ScriptedEngine, with_truth: bool) -> Expected:
        exp = Expected()

        def hook(e: ScriptedEngine, step: EngineStep) -> None:
            t = step.token_index(rid, token)
            pos, slot = int(step.positions[t]), int(step.out_cache_loc[t])
            wslot = int(e.full_to_window[slot])
            assert (e.full_pool.previous_owner(slot) is None) == fresh
            if how == "not-stored":
                step.out_cache_loc[t] = NOT_STORED
            else:
                step.drop_token(t)
            owner = e.owner(rid, pos)
            exp.step = step.index + 1
            exp.catches["full"] = Catch(rid, Phase.VERIFY, lost_write(e.full_pool, slot, owner, with_truth), slot, pos)
            exp.catches["window"] = Catch(
                rid, Phase.VERIFY, lost_write(e.window_pool, wslot, owner, with_truth), wslot, pos
            )

        def readers(e: ScriptedEngine, step: EngineStep) -> None:
            # Every request whose table holds the lost slot at this step may report it (shared prefixes).
            slot = exp.catches["full"].slot
            exp.victims = {r.rid for r in e.running if slot in e.req_to_token[r.row, : r.written].tolist()}

        engine.before_forward(at, hook)
        engine.before_forward(at + 1, readers)
        return exp

    return install


def wrong_window_lookup_entry(engine: ScriptedEngine, with_truth: bool) -> Expected:
    """Step 5: the lookup entry of request 1's position 11 points at its position 10's window slot
    (a ring mapping off by one).  Only the window group reads through the lookup."""
    exp = Expected()

    def hook(e: ScriptedEngine, step: EngineStep) -> None:
        wrong = e.window_slot_at(1, 10)
        e.full_to_window[e.slot_at(1, 11)] = wrong
        exp.step, exp.victims = step.index, {1}
        reasons = foreign_record(e.owner(1, 10), e.owner(1, 11), with_truth)
        exp.catches["window"] = Catch(1, Phase.VERIFY, reasons, wrong, 11, pred=wrong)

    engine.before_forward(5, hook)
    return exp


FAULTS: dict[str, Fault] = {
    "table-entry-to-other-request": table_entry_points_at_other_request,
    "allocator-reuses-live-slot": allocator_reuses_live_slot,
    "positions-off-by-one-at-chunk-boundary": positions_off_by_one_at_chunk_boundary,
    "table-entries-swapped": table_entries_of_two_requests_swapped,
    "writes-swapped": writes_of_two_requests_swapped,
    # Fresh slots mid-chunk (step 0), read at step 1 by request 1 and by request 3 through the
    # shared prefix; a reused slot (step 11), whose stale record is read at step 12.
    "dropped-write-not-stored-mid-chunk": dropped_write(rid=1, at=0, token=2, how="not-stored", fresh=True),
    "dropped-write-stamp-skipped-reused-slot": dropped_write(rid=4, at=11, token=0, how="stamp-skipped", fresh=False),
    "wrong-window-lookup": wrong_window_lookup_entry,
}


def expected_row(run: Run, step: int, group: str, catch: Catch) -> dict[Field, int]:
    groups = dict(zip(GROUPS, run.engine.canary_groups(), strict=True))
    row = {
        Field.PHASE: int(catch.phase),
        Field.GROUP: groups[group].group_id,
        Field.REASONS: catch.reasons,
        Field.SLOT: catch.slot,
        Field.BATCH_ROW: run.steps[step].batch_row(catch.rid),
        Field.TABLE_ROW: run.engine.request(catch.rid).row,
        Field.EXPECTED_POSITION: catch.position,
    }
    if catch.pred is not None:
        row[Field.PRED] = catch.pred
    return row


@WITH_TRUTH
@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_is_caught_at_the_step_it_first_affects(fault: str, with_truth: bool) -> None:
    engine = ScriptedEngine(standard_workload())
    exp = FAULTS[fault](engine, with_truth)
    run = run_workload(engine, with_truth)
    assert exp.step is not None, "the fault's hook never ran"
    assert exp.catches

    before = [(k, g) for k in range(exp.step) for g in GROUPS if run.reports[k][g].shape[0]]
    assert before == [], "violations reported before the fault could be seen"
    at = run.reports[exp.step]
    for group in GROUPS:
        rows = at[group]
        if group not in exp.catches:
            assert rows.shape[0] == 0, f"{group} cannot see this fault but reported {rows.tolist()}"
            continue
        want = expected_row(run, exp.step, group, exp.catches[group])
        assert rows.shape[0] > 0, f"{group} missed the fault at step {exp.step}"
        got = {f: int(rows[0, f]) for f in want}
        assert got == want, f"{group}: first row {rows[0].tolist()}"
        named = {int(r) for r in rows[:, Field.TABLE_ROW]}
        assert named <= {run.engine.request(rid).row for rid in exp.victims}
