"""Padding each step's batch to a shape class (``batch_shapes``): the padding is inert and the keys recur.

The canary's step graphs key on the batch tensors' shapes; padded rows, tokens and truth writes must change
no table cell, no record and no report, while steps of different sizes inside one class share one key.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from kvcanary.adapters.transformers_cb import binding
from kvcanary.adapters.transformers_cb.batch_shapes import SMALLEST, StepShape, bucket, bucket_tokens, widen
from kvcanary.adapters.transformers_cb.step_buffers import StableWrites
from kvcanary.adapters.transformers_cb.translate import StepTranslator
from kvcanary.adapters.transformers_cb.truth_store import TruthStore
from kvcanary.runtime.step_graphs import batch_key
from kvcanary.schema import NOT_STORED, UNKNOWN_TOKEN
from test_adapter_transformers_translate_kernel import engine
from transformers_helpers import StaticInputs, demo_run, geometry, growing

MAX_BATCH = 24  # above the smallest class: a batch of 17 rows pads to 24


def test_bucket_rounds_up_to_a_power_of_two_within_the_cap() -> None:
    got = [bucket(n, 40) for n in (0, 1, 2, 15, 16, 17, 32, 33, 40, 41)]
    assert got == [0, SMALLEST, SMALLEST, 16, 16, 32, 32, 40, 40, 41]
    assert bucket(3, 12) == 12  # the cap below the smallest class


def test_token_classes_grow_fourfold_within_the_cap() -> None:
    got = [bucket_tokens(n, 3000) for n in (0, 1, 16, 17, 32, 64, 65, 256, 257, 1025, 2999, 3000, 3001)]
    assert got == [0, SMALLEST, 16, 64, 64, 64, 256, 256, 1024, 3000, 3000, 3000, 3001]


def test_widen_views_the_storage_and_refuses_what_it_does_not_hold() -> None:
    buf = torch.arange(10, dtype=torch.int32)
    t = buf[2:5]
    assert widen(t, 3) is t
    w = widen(t, 8)
    assert w is not None and w.data_ptr() == t.data_ptr() and w.tolist() == list(range(2, 10))
    assert widen(t, 9) is None  # past the storage
    assert widen(buf[::2], 6) is None  # not contiguous


def test_step_shape_keeps_the_tokens_when_the_engine_buffer_is_short() -> None:
    ids, pos = torch.zeros(5, dtype=torch.int32), torch.zeros(5, dtype=torch.int32)
    shape = StepShape.padded(3, ids, pos, max_batch=64, max_tokens=64)
    assert shape.rows == SMALLEST and shape.input_ids is ids and shape.tokens == 5


def test_padded_truth_rows_read_row_zero() -> None:
    eng = engine(0, 3)
    _, host = eng.step({"r0": 5, "r1": 2, "r2": 1})
    store = TruthStore(MAX_BATCH, 16, torch.device("cpu"))
    update = store.plan(growing(host), [True] * 3)
    wide = update.padded(5)
    assert wide.gather.tolist() == [*update.gather.tolist(), 0, 0] and wide.lens.tolist() == [
        *update.lens.tolist(),
        0,
        0,
    ]
    assert wide.cells is update.cells and wide.tokens is update.tokens  # the writes are not padded
    got = store.apply(wide, *(torch.from_numpy(np.asarray(a)) for a in (wide.cells, wide.tokens, wide.gather)))
    assert torch.equal(got[4:], got[:1].expand(2, -1)) and (got[0] == UNKNOWN_TOKEN).all()


def padded_translators(window: int) -> tuple[StepTranslator, StepTranslator]:
    make = functools.partial(StepTranslator, [geometry(window)], max_batch=MAX_BATCH, max_context=64, device="cpu")
    return make(bucket=False), make(bucket=True, max_tokens=64)


@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("window", [0, 5])
def test_a_padded_step_is_the_exact_step_plus_inert_padding(window: int, kernel: bool) -> None:
    g = geometry(window)
    eng, (exact, padded) = engine(window, 3), padded_translators(window)
    exact.kernel = padded.kernel = kernel
    static = StaticInputs()
    for queries in ({"r0": 6, "r1": 3, "r2": 2}, dict.fromkeys(["r0", "r1", "r2"], 1), {"r0": 1, "r2": 1}):
        kwargs, host = eng.step(queries)
        want = exact.translate(kwargs, host).batches[g.name]
        got = padded.translate(static.put(kwargs), host).batches[g.name]
        b, n = want.batch_size, want.num_tokens
        assert got.batch_size == bucket(b, MAX_BATCH) and got.num_tokens == bucket_tokens(n, 64)
        for field in ("rows", "prefix_lens", "extend_lens", "truth_lens"):
            w, x = getattr(want, field), getattr(got, field)
            assert torch.equal(x[:b], w) and not x[b:].any(), field
        assert torch.equal(got.truth[: b + 1, : want.truth.shape[1]], want.truth)
        assert torch.equal(got.input_ids[:n], want.input_ids) and torch.equal(got.positions[:n], want.positions)
        assert torch.equal(got.out_cache_loc[:n], want.out_cache_loc)
        assert (got.out_cache_loc[n:] == NOT_STORED).all()
        assert torch.equal(exact.tables[g.name], padded.tables[g.name])


@pytest.mark.parametrize("window", [0, 5])
def test_steps_of_one_shape_class_share_the_graph_key(window: int) -> None:
    g = geometry(window)
    eng = engine(window, 4)
    keys: dict[bool, list[tuple[object, ...]]] = {False: [], True: []}
    for pad in (False, True):
        tr = StepTranslator([g], max_batch=MAX_BATCH, max_context=64, device="cpu", kernel=True, bucket=pad,
                            max_tokens=64)  # fmt: skip
        tr._stable = StableWrites(torch.device("cpu"))  # what CUDA gives it: static writes and truth
        tr._truth = TruthStore(MAX_BATCH, 64, torch.device("cpu"), static_out=True)
        static, eng.past = StaticInputs(), dict.fromkeys(eng.tables, 0)
        kwargs, host = eng.step(dict.fromkeys(eng.tables, 4))
        tr.translate(static.put(kwargs), growing(host), defer=True).prelude.run()  # type: ignore[union-attr]
        for rids in (["r0", "r1", "r2"], ["r0", "r1", "r2", "r3"], ["r1", "r2", "r3"]):  # 3, 4, 3 decode rows
            kwargs, host = eng.step(dict.fromkeys(rids, 1))
            t = tr.translate(static.put(kwargs), growing(host), defer=True)
            assert t.prelude is not None
            keys[pad].append((t.prelude.key, batch_key(list(t.batches.values()))))
    assert len(set(keys[False])) == 2  # 3 rows and 4 rows: two shapes, two graphs
    assert len(set(keys[True])) == 1


@pytest.mark.parametrize(("kind", "fault"), [("dense", "slot-mapping-foreign"), ("hybrid", "window-ring-off-by-one")])
def test_padding_changes_no_detection_and_no_report_on_the_engine(
    kind: str, fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = {}
    for pad in (False, True):
        monkeypatch.setattr(binding, "StepTranslator", functools.partial(StepTranslator, bucket=pad))
        runs[pad] = demo_run(kind, fault=fault, requests=12)
    plain, padded = runs[False], runs[True]
    counts = [{k: v for k, v in run.stats.items() if not k.endswith("_us")} for run in (plain, padded)]
    assert plain.detected and counts[0] == counts[1] and counts[0]["verified_slots"] > 0
    assert [r.violations for r in plain.reports] == [r.violations for r in padded.reports]
    assert [r.affected_request_ids for r in plain.reports] == [r.affected_request_ids for r in padded.reports]
