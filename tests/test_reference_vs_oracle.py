"""The vectorised reference against the scalar oracle on random clean and corrupted batches.

Each example is one step (plan, verify, stamp) of a random case from ``gen``; after every phase the
records, the workspace prefixes and the whole log (first K, last K, counters) must be identical.
Slots stamped twice in one step are the only exception: which write wins is unspecified.
"""

from __future__ import annotations

import collections

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gen
import oracle
from kvcanary.ops import reference as ref
from kvcanary.schema import NUM_REASONS, Counter, Field, Reason
from kvcanary.workspace import GroupState

EXAMPLES = 320  # per test; two tests (clean, corrupted) give 640 random batches

_SETTINGS = settings(
    max_examples=EXAMPLES,
    derandomize=True,  # CI sees the same examples every run
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _compare_phases(case: gen.Case) -> None:
    """Run both implementations phase by phase on clones of ``case``; fail on the first difference."""
    a, b = case.clone(), case.clone()
    ref.plan(GroupState(a.group, a.records, a.ws, a.log), a.batch)
    oracle.plan(b.group, b.batch, b.records, b.ws, b.log)
    diffs = gen.diff_outputs(a, b)
    assert not diffs, f"plan: {case.describe()}\n" + "\n".join(diffs)

    ref.verify(GroupState(a.group, a.records, a.ws, a.log), a.batch, a.caps.verify_entries)
    oracle.verify(b.group, b.batch, b.records, b.ws, b.log, b.caps.verify_entries)
    diffs = gen.diff_outputs(a, b)
    assert not diffs, f"verify: {case.describe()}\n" + "\n".join(diffs)

    ref.stamp(GroupState(a.group, a.records, a.ws, a.log), a.batch)
    twice = oracle.stamp(b.group, b.batch, b.records, b.ws, b.log)
    diffs = gen.diff_outputs(a, b, skip_slots=twice)
    assert not diffs, f"stamp: {case.describe()}\n" + "\n".join(diffs)
    for slot, writes in twice.items():
        # Unspecified winner, but it must be one of the step's writes to that slot, stored whole.
        got = (int(a.records.tokens[slot]), int(a.records.positions[slot]), int(a.records.links[slot]))
        assert got in writes, f"stamp: {case.describe()}\nslot {slot} holds {got}, none of {writes}"


@_SETTINGS
@given(seed=st.integers(0, 2**32 - 1))
def test_clean_batches_match(seed: int) -> None:
    _compare_phases(gen.random_case(seed, corrupt=False))


@_SETTINGS
@given(seed=st.integers(0, 2**32 - 1))
def test_corrupted_batches_match(seed: int) -> None:
    _compare_phases(gen.random_case(seed, corrupt=True))


# --------------------------------------------------------------------------- the comparison can fail


def _perturbations() -> list[tuple[str, object]]:
    def token(c: gen.Case) -> None:
        c.records.tokens[int((c.records.links != 0).nonzero()[0])] += 1

    def link(c: gen.Case) -> None:
        c.records.links[int((c.records.links != 0).nonzero()[-1])] ^= 1 << 40

    def seed_link(c: gen.Case) -> None:
        c.ws.seed_links[0] += 2

    def offsets(c: gen.Case) -> None:
        c.ws.verify_offsets[c.batch.batch_size] += 1

    def read_mark(c: gen.Case) -> None:
        c.ws.read_marks[-1] += 1

    def write_mark(c: gen.Case) -> None:
        c.ws.write_marks[0] ^= 1

    def counter(c: gen.Case) -> None:
        c.log.counters[Counter.STAMPED] += 1

    def row_field(c: gen.Case) -> None:
        c.log.first[0, Field.EXPECTED_LINK] += 1

    def last_row(c: gen.Case) -> None:
        c.log.last[-1, Field.SLOT] -= 1

    return [
        ("records.tokens", token),
        ("records.links", link),
        ("workspace.seed_links", seed_link),
        ("workspace.verify_offsets", offsets),
        ("workspace.read_marks", read_mark),
        ("workspace.write_marks", write_mark),
        ("log.counters", counter),
        ("log.first", row_field),
        ("log.last", last_row),
    ]


@pytest.mark.parametrize(("what", "perturb"), _perturbations(), ids=[p[0] for p in _perturbations()])
def test_comparator_reports_a_perturbed_output(what: str, perturb: object) -> None:
    # A corrupted case whose log starts empty and fills every row of ``first`` and ``last``.
    for s in range(200):
        case = gen.random_case(s, corrupt=True)
        a = gen.run_reference(case)
        if case.log.total() == 0 and a.log.total() >= 2 * a.log.capacity:
            break
    else:
        pytest.fail("no suitable case among the first 200 seeds")
    b = case.clone()
    oracle.step(b.group, b.batch, b.records, b.ws, b.log, b.caps.verify_entries)
    assert gen.diff_outputs(a, b) == []
    perturb(b)  # type: ignore[operator]
    diffs = gen.diff_outputs(a, b)
    assert len(diffs) == 1 and diffs[0].startswith(what), diffs


def test_skipped_slots_are_the_only_exemption() -> None:
    case = gen.random_case(7, corrupt=False)
    a = gen.run_reference(case)
    b = a.clone()
    slot = int((b.records.links != 0).nonzero()[0])
    b.records.positions[slot] += 1
    assert gen.diff_outputs(a, b)
    assert gen.diff_outputs(a, b, skip_slots={slot}) == []


# --------------------------------------------------------------------------- the random cases reach every path


def test_generator_reaches_every_path() -> None:
    """Over the seeds below, the generated cases exercise every reason and every special path.

    Without this, a generator that silently stopped producing (say) lookup faults would leave the
    comparison above passing while proving nothing about them.
    """
    seen: collections.Counter[str] = collections.Counter()
    for s in range(160):
        case = gen.random_case(s, corrupt=s % 4 != 0)
        g, b = case.group, case.batch
        out = case.clone()
        twice = oracle.step(out.group, out.batch, out.records, out.ws, out.log, out.caps.verify_entries)
        delta = out.log.counters - case.log.counters
        for bit in range(NUM_REASONS):
            if delta[bit] > 0:
                seen[Reason(1 << bit).name or ""] += 1
        seen["page>1"] += g.page_size > 1
        seen["lookup"] += g.uses_lookup
        seen["window without lookup"] += g.window > 0 and not g.uses_lookup
        seen["draft offset"] += g.token_offset == 1
        seen["no padding row"] += g.padding_row is None
        seen["padding rows"] += bool(g.padding_row is not None and (b.rows == g.padding_row).any())
        seen["reserved"] += bool(g.reserved_slots)
        seen["truth"] += b.truth is not None
        seen["batch of 1"] += b.batch_size == 1
        seen["batch >= 8"] += b.batch_size >= 8
        seen["int32 table"] += b.table.dtype == torch.int32
        seen["int64 table"] += b.table.dtype == torch.int64
        seen["overflow"] += bool(delta[Counter.SKIPPED] > 0)
        seen["log wrapped"] += out.log.total() > 2 * out.log.capacity
        seen["log carried over"] += case.log.total() > 0
        seen["written twice"] += bool(twice)
        seen["clean and silent"] += s % 4 == 0 and int(delta[Counter.VIOLATIONS]) == 0
        seen["prefill"] += bool(((case.batch.prefix_lens == 0) & (case.batch.extend_lens > 1)).any())
        seen["decode"] += bool(((case.batch.prefix_lens > 0) & (case.batch.extend_lens == 1)).any())
    # digest_mismatch comes from the KV digest's bytes, not from records (tests/test_digest_*.py).
    missing = [r.name for r in Reason if seen[r.name or ""] == 0 and r is not Reason.DIGEST_MISMATCH]
    missing += [k for k, v in seen.items() if v == 0]
    assert not missing, f"never exercised: {missing}; counts {dict(seen)}"
