"""A steady step (a step of the last full step's shape class, the engine's buffers where they were: a decode step of
the same requests, or one after requests left or joined when the batch is padded to a class) hands out the last
translation again with new values staged; every other step takes the full path.  Either way the batches, the table
and the truth equal the torch path's, step by step.  Under the interpreter on CPU."""

from __future__ import annotations

import dataclasses
import functools
import os
import random
import sys
from typing import Any

import pytest
import torch

import compiled_build

pytest.importorskip("triton")

from kvcanary.adapters.transformers_cb import binding
from kvcanary.adapters.transformers_cb.host_batch import History, HostBatch
from kvcanary.adapters.transformers_cb.translate import StepTranslator
from kvcanary.adapters.transformers_cb.translation import Translation
from kvcanary.runtime.pump import CopyFence
from kvcanary.schema import NOT_STORED
from test_adapter_transformers_cost import c_calls_by_module
from transformers_helpers import PAGE, FakeEngine, StaticInputs, demo_run, geometry, growing, kwargs_to

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # set by conftest where no GPU is


class Groups:
    """Fake engines of several groups (one per window, 0: full attention) over the same requests, their index
    tensors handed as one forward's (each group's at its own index)."""

    def __init__(self, windows: tuple[int, ...], tables: dict[str, list[int]], tokens: dict[str, list[int]]) -> None:
        self.geometries = [dataclasses.replace(geometry(w), index=i) for i, w in enumerate(windows)]
        self.engines = [FakeEngine(g, tables, tokens) for g in self.geometries]
        self.tables, self.tokens, self.past = tables, tokens, self.engines[0].past

    def step(self, queries: dict[str, int]) -> tuple[dict[str, Any], HostBatch]:
        steps = [e.step(queries) for e in self.engines]
        kwargs, host = steps[0]
        for more, _ in steps[1:]:
            kwargs["read_index"] += more["read_index"]
            kwargs["write_index"] += more["write_index"]
            kwargs["cu_seq_lens_k"] |= more["cu_seq_lens_k"]
        return kwargs, host


class Pair:
    """The torch path and the one-launch path with CUDA's static buffers, fed the same steps."""

    def __init__(
        self, window: int, n: int = 3, *, windows: tuple[int, ...] | None = None, bucket: bool = False,
        slotted: bool = False,
    ) -> None:  # fmt: skip
        """``windows``: a group per window (0: full attention) instead of the one group of ``window``; ``bucket``:
        the one-launch path pads each batch to a shape class, as on CUDA; ``slotted``: the staging follows a
        publishing manager's fence, its bytes uploaded by each step's prelude (the fence moved on after each step as
        that manager's host step and publish would)."""
        rids = [f"r{i}" for i in range(n)]
        tables = {rid: [4 + 6 * i + k for k in range(6)] for i, rid in enumerate(rids)}
        tokens = {rid: [100 * i + p + 1 for p in range(6 * PAGE)] for i, rid in enumerate(rids)}
        self.eng = Groups(windows or (window,), tables, tokens)
        gs = self.eng.geometries
        self.plain = StepTranslator(gs, max_batch=4, max_context=64, device=DEVICE, kernel=False, bucket=False)
        # The fused one as CUDA lays it out (static writes and truth), on the CPU too.
        self.fused = StepTranslator(
            gs,
            max_batch=4,
            max_context=64,
            device=DEVICE,
            bucket=bucket,
            static=True,
            max_tokens=64 if bucket else None,
        )
        self.fence: CopyFence | None = None
        if slotted:
            self.fence = CopyFence()
            self.fence.seq = torch.zeros(2, dtype=torch.int64, device=DEVICE)
            self.fused.follow(self.fence)
        self.static = StaticInputs(DEVICE)
        self.last: Translation | None = None
        self.seen: list[Translation] = []  # every translation handed out

    def step(
        self, queries: dict[str, int], *, fresh_buffers: bool = False, buffers: StaticInputs | None = None
    ) -> bool:
        """One step on both, compared; whether the one-launch path's step was steady (a kept translation handed out
        again).  ``buffers``: the engine's buffer set for this step (async batching alternates two)."""
        kwargs, host = self.eng.step(queries)
        host = growing(host)
        want = self.plain.translate(kwargs_to(kwargs, DEVICE), host)
        inputs = kwargs_to(kwargs, DEVICE) if fresh_buffers else (buffers or self.static).put(kwargs)
        steady = self.fused.steady_steps
        got = self.fused.translate(inputs, host, defer=True)
        assert got.prelude is not None
        got.prelude.run()
        (same_padded if self.fused.bucket else same_batches)(want, got)
        for g in self.eng.geometries:
            assert torch.equal(self.plain.tables[g.name].cpu(), self.fused.tables[g.name].cpu()), g.name
        assert got.ring_wraps == want.ring_wraps and got.request_ids == want.request_ids
        if self.fence is not None and self.fence.seq is not None:  # the host step, and the publish of the step's work
            self.fence.landed = self.fence.next_step
            self.fence.next_step += 1
            self.fence.seq[0] += 1
        self.last = got
        self.seen.append(got)
        return self.fused.steady_steps > steady


def same_batches(want: Translation, got: Translation) -> None:
    for name, wb in want.batches.items():
        for field, w in wb.tensors().items():
            x = got.batches[name].tensors()[field]
            assert (w is None) == (x is None), field
            if w is not None and x is not None:
                x = x.cpu()[:, : w.shape[1]] if field == "truth" else x.cpu()  # the static truth is full width
                assert torch.equal(w.cpu().to(x.dtype), x), field


def same_padded(want: Translation, got: Translation) -> None:
    """``got`` is ``want`` padded to a shape class: inert padding rows and tokens behind the same values."""
    for name, w in want.batches.items():
        x = got.batches[name]
        b, n = w.batch_size, w.num_tokens
        for field in ("rows", "prefix_lens", "extend_lens", "truth_lens"):
            assert torch.equal(getattr(x, field)[:b].cpu(), getattr(w, field).cpu()), field
            assert not getattr(x, field)[b:].any(), field
        assert torch.equal(x.truth[: b + 1, : w.truth.shape[1]].cpu(), w.truth.cpu())
        assert torch.equal(x.input_ids[:n].cpu(), w.input_ids.cpu())
        assert torch.equal(x.positions[:n].cpu(), w.positions.cpu())
        assert torch.equal(x.out_cache_loc[:n].cpu(), w.out_cache_loc.cpu())
        assert (x.out_cache_loc[n:] == NOT_STORED).all()


@pytest.mark.parametrize("window", [0, 5, 3])  # 3: the 4-token query overflows the window (trash by design)
def test_requests_that_leave_and_join_within_the_shape_class_keep_the_step_steady(window: int) -> None:
    """Padded to a class (as on CUDA), a batch that lost a request or gained one keeps the kept translation: its
    launches read every length from the staged arrays, whose padding rows go back to zero, and a window's writes
    to the trash by design from a staged mask."""
    pair = Pair(window, n=4, bucket=True)
    first = dict.fromkeys(["r0", "r1", "r2"], 1)
    assert not pair.step(dict.fromkeys(first, 6))  # a prefill: the full path
    assert not pair.step(first)  # the first decode step: a new class
    got = [
        pair.step(first),
        pair.step(dict.fromkeys(["r0", "r2"], 1)),  # r1 finished
        pair.step({"r0": 1, "r2": 1, "r3": 4}),  # r3 joins with its prompt
        pair.step(dict.fromkeys(["r0", "r2", "r3"], 1)),
        pair.step(dict.fromkeys(["r0", "r2", "r3"], 1)),
    ]
    assert got == [True] * 5
    assert pair.last is not None and pair.last.request_ids == ("r0", "r2", "r3")


@pytest.mark.parametrize("window", [0, 5])
def test_decode_steps_reuse_the_translation_and_translate_each_step_as_the_torch_path(window: int) -> None:
    pair = Pair(window)
    assert not pair.step(dict.fromkeys(pair.eng.tables, 6))  # a prefill: the full path
    reused = [pair.step(dict.fromkeys(pair.eng.tables, 1)) for _ in range(8)]
    assert reused == [False] + [True] * 7  # the first decode step is a new shape; the rest are steady
    assert pair.fused.steady_steps == 7


@pytest.mark.parametrize("windows", [(5, 0), (0, 3, 7)])
def test_steady_steps_of_several_groups_translate_each_step_as_the_torch_path(windows: tuple[int, ...]) -> None:
    """A hybrid model's groups (sliding and full) share the staged arrays; each keeps its own launch and table."""
    pair = Pair(0, windows=windows)
    assert not pair.step(dict.fromkeys(pair.eng.tables, 6))  # a prefill: the full path
    for _ in range(8):
        pair.step(dict.fromkeys(pair.eng.tables, 1))  # compared with the torch path, step by step
    # The first decode step is a new shape; the rest are steady (one whose ring wraps start anew hands out the
    # kept translation with its count replaced, a new object).
    assert pair.fused.steady_steps == 7


@pytest.mark.parametrize("window", [0, 5])
def test_engine_buffer_sets_that_alternate_each_reuse_their_own_translation(window: int) -> None:
    """Async batching alternates two sets of input buffers: each set's translation is kept and reused."""
    pair, sets = Pair(window), (StaticInputs(DEVICE), StaticInputs(DEVICE))
    assert not pair.step(dict.fromkeys(pair.eng.tables, 6), buffers=sets[0])
    reused = [pair.step(dict.fromkeys(pair.eng.tables, 1), buffers=sets[k % 2]) for k in range(8)]
    assert reused == [False, False] + [True] * 6  # the first decode step on each set is new; then steady
    assert pair.last is not pair.seen[-2]  # the two sets' translations bind different engine buffers


def _leave(pair: Pair) -> bool:
    return pair.step(dict.fromkeys(list(pair.eng.tables)[:2], 1))


def _two_tokens(pair: Pair) -> bool:
    return pair.step(dict.fromkeys(pair.eng.tables, 2))


def _moved_buffers(pair: Pair) -> bool:
    return pair.step(dict.fromkeys(pair.eng.tables, 1), fresh_buffers=True)


def _staging_grew(pair: Pair) -> bool:
    pair.fused._staging._grow(1 << 20)  # new device buffer: every staged view moves
    return pair.step(dict.fromkeys(pair.eng.tables, 1))


def _forgotten(pair: Pair) -> bool:
    pair.fused.forget_truth()
    return pair.step(dict.fromkeys(pair.eng.tables, 1))


def _rewritten_history(pair: Pair) -> bool:
    """A token the truth already holds changes (a rolled-back draft): still steady, and the truth is resent."""
    rid = next(iter(pair.eng.tables))
    pair.eng.tokens[rid][pair.eng.past[rid] - 2] += 1000
    return pair.step(dict.fromkeys(pair.eng.tables, 1))


@pytest.mark.parametrize(
    ("change", "steady"),
    [
        (_leave, False),
        (_two_tokens, False),
        (_moved_buffers, False),
        (_staging_grew, False),
        (_forgotten, False),
        (_rewritten_history, True),
    ],
)
@pytest.mark.parametrize("window", [0, 5])
def test_a_step_that_breaks_the_pattern_takes_the_full_path_and_the_next_is_steady_again(
    change: Any, steady: bool, window: int
) -> None:
    pair = Pair(window)
    pair.step(dict.fromkeys(pair.eng.tables, 6))
    for _ in range(3):
        pair.step(dict.fromkeys(pair.eng.tables, 1))
    assert change(pair) == steady
    rows = dict.fromkeys(list(pair.eng.tables)[: 2 if change is _leave else 3], 1)
    pair.step(rows)  # may set the pattern again (a new query length, buffers back where they were)
    assert pair.step(rows)


def test_a_row_that_would_outgrow_the_table_is_not_steady() -> None:
    pair = Pair(0, n=1)
    pair.step({"r0": 6})
    pair.step({"r0": 1})
    assert pair.step({"r0": 1})
    kwargs, host = pair.eng.step({"r0": 1})
    inputs = pair.static.put(kwargs)
    before = pair.fused.steady_steps
    too_long = dataclasses.replace(growing(host), past_lens=(64,))  # the step would end past the table (64 wide)
    got = pair.fused.translate(inputs, too_long, defer=True)
    assert pair.fused.steady_steps == before and got.rows_too_long == 1  # the full path left the row out
    again = pair.fused.translate(inputs, growing(host), defer=True)  # the same step, the row fitting: steady
    assert pair.fused.steady_steps == before + 1 and again.rows_too_long == 0


# The distinct torch callables a steady step touches: the engine tensors' addresses, the token count and index sizes,
# and on CUDA the current stream (the staging's upload).  Each costs microseconds on first touch in a serving loop
# (see the cost tests); lower it, never raise it.  (Attribute getters such as ``dtype`` are not counted here.)
STEADY_PATH_TORCH_CALLABLES = 3 if DEVICE == "cuda" else 2


def _before_a_steady_step(window: int) -> tuple[Pair, dict[str, Any], HostBatch]:
    """A pair after a prefill and two decode steps, and the next decode step's inputs and host batch (the histories
    captured as :class:`History`, as the adapter does): that step is steady."""
    pair = Pair(window)
    pair.step(dict.fromkeys(pair.eng.tables, 6))
    for _ in range(2):
        pair.step(dict.fromkeys(pair.eng.tables, 1))
    kwargs, host = pair.eng.step(dict.fromkeys(pair.eng.tables, 1))
    host = growing(host)
    return (
        pair,
        pair.static.put(kwargs),
        dataclasses.replace(host, truth=tuple(History(list(t), []) for t in host.truth)),
    )


@pytest.mark.parametrize("window", [0, 3])
def test_a_steady_step_calls_no_numpy_and_few_distinct_torch_functions(window: int) -> None:
    pair, inputs, host = _before_a_steady_step(window)
    got: list[Translation] = []
    calls = c_calls_by_module(lambda: got.append(pair.fused.translate(inputs, host, defer=True)))
    assert got[0] is pair.last  # steady
    assert "numpy" not in calls, calls["numpy"]
    assert len(calls["torch"]) <= STEADY_PATH_TORCH_CALLABLES, sorted(calls["torch"])


@pytest.mark.skipif(not INTERPRETED, reason="the CUDA layout on the CPU demo engine runs Triton's interpreter")
@compiled_build.patches("kvcanary.adapters.transformers_cb.binding")
@pytest.mark.parametrize(("kind", "fault"), [("dense", "slot-mapping-foreign"), ("hybrid", "window-ring-off-by-one")])
def test_the_cuda_layout_with_its_steady_steps_changes_no_detection_on_the_engine(
    kind: str, fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo's engine run through the translator as CUDA lays it out (one launch a group, static buffers, shape
    classes, so requests that finish or join keep the step steady) finds what the CPU's layout finds, step by step."""
    runs = {}
    for cuda_layout in (False, True):
        layout = {"static": True, "kernel": True, "bucket": True} if cuda_layout else {}
        monkeypatch.setattr(binding, "StepTranslator", functools.partial(StepTranslator, **layout))
        runs[cuda_layout] = demo_run(kind, fault=fault, requests=12)
    plain, cuda = runs[False], runs[True]
    counts = [{k: v for k, v in run.stats.items() if not k.endswith("_us")} for run in (plain, cuda)]
    assert plain.detected and counts[0] == counts[1] and counts[0]["verified_slots"] > 0
    assert [(r.step, r.violations) for r in plain.reports] == [(r.step, r.violations) for r in cuda.reports]
    assert [r.affected_request_ids for r in plain.reports] == [r.affected_request_ids for r in cuda.reports]
    assert plain.features["steady_steps"] == 0 and cuda.features["steady_steps"] > counts[0]["steps"] // 2


@pytest.mark.parametrize("slotted", [False, True], ids=["copied", "slotted"])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("window", [0, 3, 5])
def test_random_joins_leaves_and_chunks_translate_each_step_as_the_torch_path(
    window: int, seed: int, slotted: bool
) -> None:
    """Random batches of one class (requests joining, leaving, coming back, chunks of 1-5 tokens, some past a
    window): every step, steady or not, translates as the torch path does; with the staging slotted too."""
    rng = random.Random(seed)
    pair = Pair(window, n=4, bucket=True, slotted=slotted)
    assert (pair.fused._staging.upload() is not None) is slotted
    pair.step(dict.fromkeys(["r0", "r1", "r2"], 6))
    cap = 6 * PAGE  # each request's block table
    for _ in range(12):
        queries = {r: min(rng.choice([1, 1, 1, 2, 5]), cap - pair.eng.past[r]) for r in pair.eng.tables}
        queries = {r: q for r, q in queries.items() if q > 0 and rng.random() < 0.75}
        if queries:
            pair.step(queries)  # compared with the torch path, field by field, and the tables
    assert pair.fused.steady_steps >= 4


# The distinct Python functions a steady step runs (the engine's histories captured as History, as the adapter does).
# On a serving loop each one costs microseconds the first time after a forward, whatever it computes (see
# benchmarks/bench_translate.py --cold), so this is the step's cold cost; lower it, never raise it.
# On CUDA the staging's upload adds three: the transfer's send and landed, and the CUDA bindings' enum of the calls'
# results.
STEADY_PATH_PY_FUNCTIONS = {w: n + (3 if DEVICE == "cuda" else 0) for w, n in {0: 18, 3: 21}.items()}


@pytest.mark.parametrize("window", [0, 3])
def test_a_steady_step_runs_few_distinct_python_functions(window: int) -> None:
    pair, inputs, host = _before_a_steady_step(window)
    ran: set[str] = set()
    got: list[Translation] = []

    def hook(frame: Any, event: str, arg: object) -> None:
        if event == "call":
            ran.add(frame.f_code.co_qualname)

    sys.setprofile(hook)
    try:
        got.append(pair.fused.translate(inputs, host, defer=True))
    finally:
        sys.setprofile(None)
    assert got[0] is pair.last  # steady
    assert len(ran) <= STEADY_PATH_PY_FUNCTIONS[window], sorted(ran)


@compiled_build.patches("kvcanary.adapters.transformers_cb.steady_step")
def test_kept_classes_drop_the_least_recently_found_one_first() -> None:
    from kvcanary.adapters.transformers_cb.steady_step import MAX_CLASSES, KeptSteps, SteadyStep

    def kept_step(shape: tuple[int, int]) -> SteadyStep:
        translations: dict[Any, Any] = {("sig",): f"translation {shape}"}
        return SteadyStep(shape=shape, views=(), translations=translations, pending=None, region=object())  # type: ignore[arg-type]

    kept = KeptSteps()
    shapes = [(i, 16 * i) for i in range(1, MAX_CLASSES + 1)]
    for shape in shapes:
        kept.keep(kept_step(shape))
    for _ in range(2):  # the oldest class found again (twice: the second time it is the newest already)
        found = kept.find(shapes[0], ("sig",))
        assert found is not None and found[1] == f"translation {shapes[0]}"
    assert kept.find(shapes[1], ("other",)) is None  # a class found without a translation for these tensors
    kept.keep(kept_step((99, 99)))  # one class too many: the least recently used one goes
    assert kept.get(shapes[0]) is not None and kept.get(shapes[1]) is None and kept.get((99, 99)) is not None
