"""The transformers adapter's translation pieces, without running the engine (fast).

A small hand-written model of transformers' index layout (physical index = block * stride + offset;
full groups read every past token then the new ones, sliding groups read min(past, W - 1) ring slots
then sentinel copies) drives the translator and the reference canary over a few steps.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import compiled_build
from kvcanary import Capacities, GroupCanary, Reason, ViolationLog
from kvcanary.adapters.transformers_cb import byte_moves, mirror
from kvcanary.adapters.transformers_cb.geometry import GroupGeometry
from kvcanary.adapters.transformers_cb.host_batch import HostBatch
from kvcanary.adapters.transformers_cb.translate import StepTranslator
from kvcanary.adapters.transformers_cb.translation import Translation
from kvcanary.layout import GroupKind, RecordStore
from kvcanary.schema import NOT_STORED, Counter, Field, Phase
from transformers_helpers import BPS, PAGE, STRIDE, FakeEngine, geometry


def make_canary(g: GroupGeometry, width: int = 64) -> tuple[StepTranslator, GroupCanary, ViolationLog]:
    caps = Capacities(max_batch=4, max_tokens=64, verify_entries=256, max_context=width)
    canary = GroupCanary(g.canary_group(0), caps)
    return StepTranslator([g], max_batch=4, max_context=width, device="cpu"), canary, canary.new_log()


def run(
    tr: StepTranslator, canary: GroupCanary, log: ViolationLog, kwargs: dict[str, Any], host: HostBatch
) -> Translation:
    t = tr.translate(kwargs, host)
    canary.step(t.batches[canary.group.name], log)
    return t


TOKENS = {"a": list(range(100, 140)), "b": list(range(200, 240))}


def scenario(window: int) -> tuple[FakeEngine, StepTranslator, GroupCanary, ViolationLog]:
    g = geometry(window)
    tables = {"a": [4, 5, 6], "b": [8, 9, 10]} if not window else {"a": [4], "b": [8]}
    eng = FakeEngine(g, tables, TOKENS)
    return (eng, *make_canary(g))


# ---------------------------------------------------------------------------- geometry


def test_a_batch_of_transformers_warm_up_requests_is_told_from_a_served_one() -> None:
    def batch(*ids: str) -> HostBatch:
        return HostBatch(ids, (0,) * len(ids), (1,) * len(ids), tuple([1] for _ in ids))

    assert batch("__warmup_DECODING_0__", "__warmup_DECODING_1__").is_warmup
    assert not batch("req_0", "req_1").is_warmup
    assert not batch("req__warmup_0").is_warmup and not batch("__warm").is_warmup and not batch().is_warmup


def test_geometry_maps_physical_indices_compactly_and_rejects_other_layers_rows() -> None:
    g = geometry()
    idx = torch.tensor([0, 1, 3, 4, STRIDE * 5 + 2, -3, STRIDE * g.num_blocks, STRIDE * BPS])
    slots = g.to_slots(idx).tolist()
    assert slots == [0, g.sentinel_slot, 3, g.invalid_slot, 5 * PAGE + 2, g.invalid_slot, g.invalid_slot, BPS * PAGE]
    assert g.block_slots(torch.tensor([5, 2])).tolist() == [20, 21, 22, 23, 8, 9, 10, 11]
    group = g.canary_group(3)
    assert group.reserved_slots == (0, BPS * PAGE, g.sentinel_slot)
    assert group.num_slots == g.num_slots == g.invalid_slot
    assert group.kind is GroupKind.FULL and group.page_size == 1


def test_geometry_sliding_window_is_w_minus_one_and_w1_is_refused() -> None:
    group = geometry(window=5).canary_group(0)
    assert group.kind is GroupKind.SLIDING_WINDOW and group.window == 4
    with pytest.raises(ValueError, match="sliding_window=1"):
        geometry(window=1)


# ---------------------------------------------------------------------------- translation, full group


def test_full_group_clean_steps_are_silent_and_tables_come_from_the_read_index() -> None:
    eng, tr, canary, log = scenario(0)
    run(tr, canary, log, *eng.step({"a": 6, "b": 3}))
    for _ in range(4):
        kwargs, host = eng.step({"a": 1, "b": 1})
        t = run(tr, canary, log, kwargs, host)
    assert log.total() == 0 and int(log.counters[Counter.VERIFIED]) > 0
    table = t.batches["full_attention"].table
    assert table[1, :9].tolist() == eng.g.to_slots(torch.tensor([eng.phys("a", p) for p in range(9)])).tolist()
    assert t.request_ids == ("a", "b") and not t.padded


def test_full_group_swapped_read_indices_are_caught_for_that_request() -> None:
    eng, tr, canary, log = scenario(0)
    run(tr, canary, log, *eng.step({"a": 6, "b": 3}))
    kwargs, host = eng.step({"a": 1, "b": 1})
    read = kwargs["read_index"][0]  # a's segment comes first: past 0..5
    read[[1, 4]] = read[[4, 1]].clone()
    run(tr, canary, log, kwargs, host)
    rows = log.rows()
    assert log.total() > 0
    assert set(rows[:, Field.BATCH_ROW].tolist()) == {0}  # request "a" only
    assert set(rows[:, Field.EXPECTED_POSITION].tolist()) >= {1, 4}


def test_a_mis_delimited_read_segment_is_reported_not_trusted() -> None:
    eng, tr, canary, log = scenario(0)
    run(tr, canary, log, *eng.step({"a": 6, "b": 3}))
    kwargs, host = eng.step({"a": 1, "b": 1})
    kwargs["cu_seq_lens_k"]["full_attention"][1] -= 1  # a's segment one short, b's one long
    run(tr, canary, log, kwargs, host)
    rows = log.rows()
    verify = rows[rows[:, Field.PHASE] == Phase.VERIFY]
    assert verify.shape[0] == 6 + 3  # every past token of both requests
    assert bool(((verify[:, Field.REASONS] & Reason.SLOT_OUT_OF_RANGE) != 0).all())


def test_write_to_the_trash_in_a_full_group_is_a_reserved_slot_violation() -> None:
    eng, tr, canary, log = scenario(0)
    kwargs, host = eng.step({"a": 2})
    kwargs["write_index"][0][1] = eng.g.write_trash_index
    run(tr, canary, log, kwargs, host)
    assert log.total() == 1 and int(log.rows()[0, Field.REASONS]) & Reason.RESERVED_SLOT


# ---------------------------------------------------------------------------- translation, sliding group


def _wraps_by_rule(windows: list[int], past: list[int], query: list[int], live: list[bool]) -> int:
    """Each stored write at a position >= W overwrote the ring slot of position - W; a row stores its query's last W."""
    wraps = 0
    for w in windows:
        for p, q, ok in zip(past, query, live, strict=True):
            stored = range(max(p + q - min(q, w), w), p + q)
            wraps += len(stored) if ok else 0
    return wraps


@pytest.mark.parametrize("seed", range(6))
def test_ring_wraps_count_every_overwritten_slot_on_decode_and_mixed_steps(seed: int) -> None:
    from kvcanary.adapters.transformers_cb.step_plan import RowPlan, ring_wraps

    gen = torch.Generator().manual_seed(seed)
    windows = [int(w) for w in torch.randint(2, 40, (1 + seed % 3,), generator=gen)]
    for b in (1, 7, 31):
        past = [int(p) for p in torch.randint(0, 80, (b,), generator=gen)]
        decode = [1] * b  # the counted-in-C case
        mixed = [int(q) for q in torch.randint(0, 50, (b,), generator=gen)]
        some_out = [bool(x) for x in torch.rand(b, generator=gen) < 0.8]
        for query, live in ((decode, [True] * b), (mixed, [True] * b), (decode, some_out), (mixed, some_out)):
            got = ring_wraps(windows, RowPlan(tuple(past), tuple(query), tuple(live)))
            assert got == _wraps_by_rule(windows, past, query, live), (windows, past, query, live)
    assert ring_wraps([4], RowPlan((3, 4, 9), (1, 1, 1), (True, True, True))) == 2  # rows at past 4 and 9


def test_sliding_group_wraps_its_ring_silently_and_keeps_long_queries_out_of_the_pool() -> None:
    eng, tr, canary, log = scenario(3)  # ring of 3, canary window 2
    t = run(tr, canary, log, *eng.step({"a": 7, "b": 2}))  # a: 4 trash writes, then positions 4..6
    out = t.batches["sliding_attention"].out_cache_loc.tolist()
    assert out[:4] == [NOT_STORED] * 4 and NOT_STORED not in out[4:]
    assert t.ring_wraps == 3  # a's positions 4, 5, 6 overwrote ring slots
    for _ in range(5):
        t = run(tr, canary, log, *eng.step({"a": 1, "b": 1}))
    assert log.total() == 0
    assert int(log.counters[Counter.VERIFIED]) > 0  # the window was really checked
    table = t.batches["sliding_attention"].table
    past_a = eng.past["a"] - 1
    assert int(table[1, past_a - 3]) == eng.g.read_trash_slot  # the edge before the window: reserved


def test_sliding_group_reading_a_stale_ring_slot_is_caught() -> None:
    eng, tr, canary, log = scenario(3)
    run(tr, canary, log, *eng.step({"a": 5, "b": 2}))
    kwargs, host = eng.step({"a": 1, "b": 1})
    read = kwargs["read_index"][0]  # a reads positions 3, 4
    read[0] = read[1].clone()
    run(tr, canary, log, kwargs, host)
    rows = log.rows()
    assert log.total() > 0 and set(rows[:, Field.BATCH_ROW].tolist()) == {0}
    assert int(rows[0, Field.REASONS]) & Reason.POSITION_MISMATCH


def test_a_sentinel_in_the_past_part_of_a_sliding_read_is_a_reserved_slot() -> None:
    eng, tr, canary, log = scenario(3)
    run(tr, canary, log, *eng.step({"a": 5}))
    kwargs, host = eng.step({"a": 1})
    kwargs["read_index"][0][0] = eng.g.sentinel_index
    run(tr, canary, log, kwargs, host)
    assert int(log.rows()[0, Field.REASONS]) & Reason.RESERVED_SLOT


# ---------------------------------------------------------------------------- padding, long rows, block table


def test_padded_batches_and_rows_longer_than_the_table() -> None:
    g = geometry()
    eng = FakeEngine(g, {"a": [4, 5, 6], "b": [8, 9, 10]}, TOKENS)
    tr, canary, log = make_canary(g, width=8)
    kwargs, host = eng.step({"a": 9, "b": 3})  # a is longer than the table
    pad = 5  # the engine pads tokens (write trash, position 0) and adds an empty sequence
    kwargs["input_ids"] = torch.cat([kwargs["input_ids"], torch.zeros(1, pad, dtype=torch.int32)], 1)
    kwargs["position_ids"] = torch.cat([kwargs["position_ids"], torch.zeros(1, pad, dtype=torch.int32)], 1)
    kwargs["write_index"] = [torch.cat([kwargs["write_index"][0], torch.full((pad,), g.write_trash_index)])]
    kwargs["cu_seq_lens_q"] = torch.cat([kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_q"][-1:]])
    t = run(tr, canary, log, kwargs, host)
    assert t.padded and t.rows_too_long == 1
    assert t.batches["full_attention"].rows.tolist() == [0, 2]  # a goes to the padding row: skipped
    assert log.total() == 0 and int(log.counters[Counter.STAMPED]) == 3  # b's three tokens only


def test_decode_fast_path_is_translated_from_the_block_table() -> None:
    eng, tr, canary, log = scenario(0)
    run(tr, canary, log, *eng.step({"a": 6, "b": 5}))
    kwargs, host = eng.step({"a": 1, "b": 1})
    pages_stride = STRIDE // PAGE
    bt = torch.full((1, 2, 4), -1, dtype=torch.int32)
    for r, rid in enumerate(("a", "b")):
        bt[0, r, :3] = torch.tensor(eng.tables[rid]) * pages_stride
    kwargs.update(block_table=bt, read_index=None, write_index=None)
    t = run(tr, canary, log, kwargs, host)
    assert t.block_table and log.total() == 0 and int(log.counters[Counter.VERIFIED]) == 11
    bt[0, 1, 0] = bt[0, 0, 0]  # b's first page now points at a's block
    kwargs, host = eng.step({"a": 1, "b": 1})
    kwargs.update(block_table=bt, read_index=None, write_index=None)
    run(tr, canary, log, kwargs, host)
    assert log.total() > 0 and set(log.rows()[:, Field.BATCH_ROW].tolist()) == {1}


# ---------------------------------------------------------------------------- mirrors, the tap, trash writes


def test_block_copies_move_records_with_the_blocks() -> None:
    g = geometry()
    rec = RecordStore.allocate(g.num_slots)
    rec.links[g.block_slots(torch.tensor([4]))] = torch.tensor([11, 13, 15, 17])
    mirror.apply_block_write(g, rec, byte_moves.BlockWrite((g.name,), torch.tensor([7]), torch.tensor([4])))
    assert rec.links[g.block_slots(torch.tensor([7]))].tolist() == [11, 13, 15, 17]


@compiled_build.patches("kvcanary.adapters.transformers_cb.binding")  # no Bindings: None stands in
def test_forwards_run_while_the_engine_captures_a_graph_are_not_counted_as_missed_taps() -> None:
    from kvcanary.adapters.transformers_cb.step_tap import StepTap
    from kvcanary.config import Mode

    tap = StepTap(object(), Mode.LOG, None, None, None, lambda report: None, None)  # type: ignore[arg-type]
    paged = {"cache": object(), "write_index": []}
    asked = []

    def capturing() -> bool:
        asked.append(tap.forwards_seen)
        return True

    tap._capturing = capturing  # the engine's warm-up forward, then forwards it captures (warm-up counted already)
    for _ in range(3):
        tap.pre_hook(None, (), paged)
    assert tap.forwards_seen == 1 and tap.hook_misses == 0
    assert asked == [2, 2]  # asked only when a forward would be a second one since the last tap, not on every forward
    tap.taps = 1  # the step's tap ran
    tap._capturing = None  # no capture: forwards with no tap between them are misses
    for _ in range(3):
        tap.pre_hook(None, (), paged)
    assert tap.forwards_seen == 4 and tap.hook_misses == 2


def test_the_writes_to_the_trash_by_design_are_each_rows_first_query_minus_window_tokens() -> None:
    import random

    import numpy as np

    from kvcanary.adapters.transformers_cb import step_plan

    rng = random.Random(4)
    g = geometry(3)
    for _ in range(200):
        query = tuple(rng.randrange(0, 9) for _ in range(rng.randrange(1, 6)))
        rows = step_plan.RowPlan((0,) * len(query), query, (True,) * len(query))
        n = rng.randrange(0, sum(query) + 3)  # the write entries translated: fewer, as many or more than the tokens
        want = [k < q - 3 for q in query for k in range(q)][:n]
        want += [False] * (n - len(want))
        got = step_plan.trash_writes(g, rows, n)
        if not any(want) and max(query) <= 3:
            assert got is None and step_plan.trash_mask(g, rows, n, n + 5) is None
            continue
        assert got is not None and got.tolist() == want, (query, n)
        padded = step_plan.trash_bytes(g, rows, n, n + 5)
        assert np.frombuffer(padded, dtype=np.bool_).tolist() == want + [False] * 5
    assert step_plan.trash_writes(geometry(0), step_plan.RowPlan((0,), (9,), (True,)), 9) is None  # full attention
