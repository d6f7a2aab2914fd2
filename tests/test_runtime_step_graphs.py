"""The canary's own step graphs (``CanaryManager.forward_step``): replayed only for a step whose batch
tensors sit where a captured step's sat, and then the same results as running every launch.

On the CPU a stand-in graph runs the captured work when replayed (what a CUDA graph does on the device);
the ``gpu`` test compares real CUDA graphs with eager launches on the H200.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

import compiled_build
from kvcanary import CanaryGroup, Mode, StepBatch
from kvcanary.config import CanaryConfig
from kvcanary.ops import Backend
from kvcanary.runtime import CanaryManager, StepReport
from kvcanary.runtime.step_graphs import BatchKeys, HashedKey, StepGraphs, batch_key
from runtime_helpers import CAPS, NUM_SLOTS, Workload, alias_first_slot


class FakeGraph:
    def __init__(self, work: Callable[[], None], log: list[str]) -> None:
        self._work = work
        self._log = log
        log.append("capture")  # a capture records the work without running it

    def replay(self) -> None:
        self._log.append("replay")
        self._work()


def with_fake_graphs(mgr: CanaryManager) -> list[str]:
    log: list[str] = []
    mgr._graphs = StepGraphs(lambda work: FakeGraph(work, log))
    return log


class StaticBatch:
    """One step's batch copied into tensors that keep their addresses (what the adapter's buffers do)."""

    def __init__(self) -> None:
        self._static: dict[tuple[str, int], torch.Tensor] = {}

    def __call__(self, b: StepBatch) -> StepBatch:
        def keep(name: str, t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or name == "table":
                return t
            buf = self._static.setdefault((name, t.numel()), torch.empty_like(t))
            return buf.copy_(t)

        return StepBatch(**{name: keep(name, t) for name, t in b.tensors().items()})


def run(mgr: CanaryManager, steps: int, fault_at: int | None, static: bool) -> list[StepReport | None]:
    wl, keep = Workload(), StaticBatch()
    out = []
    for k in range(steps):
        if k == fault_at:
            alias_first_slot(wl, victim=2, owner=1)
        batch = wl.batch([(1, 4 if k == 0 else 1), (2, 4 if k == 0 else 1)], truth=True)
        mgr.forward_step({"full": keep(batch) if static else batch})
        out.append(mgr.host_step(["req-a", "req-b"]))
    out.append(mgr.flush())
    return out


def manager(backend: Backend = Backend.REFERENCE, device: str = "cpu") -> CanaryManager:
    group = CanaryGroup(num_slots=NUM_SLOTS, name="full")
    return CanaryManager([group], CAPS, CanaryConfig(mode=Mode.LOG), device=device, backend=backend)


def test_a_step_is_captured_the_second_time_its_tensors_are_seen_and_replayed_after() -> None:
    mgr = manager()
    log = with_fake_graphs(mgr)
    run(mgr, 6, None, static=True)
    # steps 1.. are decode steps with the same tensors: seen at 1, captured at 2, replayed at 3, 4, 5
    assert log == ["capture", "replay", "replay", "replay"]
    stats = mgr.graph_stats()
    # step 0 (a prefill), 1 (seen) and 2 (captured after it ran) ran eagerly; their host time is counted
    assert {k: stats[k] for k in ("graph_replays", "graph_captures", "graph_eager_steps")} == {
        "graph_replays": 3, "graph_captures": 1, "graph_eager_steps": 3,
    }  # fmt: skip
    assert stats["graph_eager_us"] > 0 and stats["graph_capture_us"] >= 0
    assert manager().graph_stats() == dict.fromkeys(stats, 0)  # no graphs in use: every count zero


def test_with_first_sight_a_step_is_captured_before_it_runs_and_replayed_at_once() -> None:
    mgr = manager()
    log: list[str] = []
    mgr._graphs = StepGraphs(lambda work: FakeGraph(work, log), first_sight=True)
    run(mgr, 6, None, static=True)
    # step 0 (the prefill, seen once) and step 1 (the first decode) were each captured and replayed, no eager run;
    # steps 2..5 replay the decode's graph
    assert log == ["capture", "replay", "capture", "replay", "replay", "replay", "replay", "replay"]
    stats = mgr.graph_stats()
    assert {k: stats[k] for k in ("graph_replays", "graph_captures", "graph_eager_steps")} == {
        "graph_replays": 6, "graph_captures": 2, "graph_eager_steps": 0,
    }  # fmt: skip


def test_a_capture_that_fails_at_first_sight_runs_the_step_eagerly_and_captures_it_after(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A capture may fail (a driver that cannot load a kernel's module during a capture): the step then runs eagerly,
    is captured after, as without ``first_sight``, and finds what launching every kernel finds."""
    plain = manager()
    want = run(plain, 12, fault_at=7, static=True)
    mgr = manager()
    log: list[str] = []
    failures = [True, False, True]  # each key's capture at first sight fails, the one after its eager run does not

    def factory(work: Callable[[], None]) -> FakeGraph:
        if failures and failures.pop(0):
            raise RuntimeError("operation not permitted when stream is capturing")
        return FakeGraph(work, log)

    mgr._graphs = StepGraphs(factory, first_sight=True)
    got = run(mgr, 12, fault_at=7, static=True)
    assert mgr._graphs is not None and mgr._graphs.capture_failures == 2
    stats = mgr.graph_stats()
    assert stats["graph_capture_failures"] == 2 and plain.graph_stats()["graph_capture_failures"] == 0
    # the first failure is logged with its exception, the second only counted
    failed = [r for r in caplog.records if "capturing the canary's step graph failed" in r.getMessage()]
    assert len(failed) == 1 and failed[0].exc_info is not None and "not permitted" in str(failed[0].exc_info[1])
    # step 0: its capture failed, it ran eagerly and the retry was captured; step 1: a failed capture, an eager run,
    # then captured; steps 2..11 replay
    assert {k: stats[k] for k in ("graph_replays", "graph_captures", "graph_eager_steps")} == {
        "graph_replays": 10, "graph_captures": 2, "graph_eager_steps": 2,
    }  # fmt: skip
    assert [(r.step, r.total, r.affected_request_ids) for r in got if r is not None] == [
        (r.step, r.total, r.affected_request_ids) for r in want if r is not None
    ]
    assert mgr.stats() == plain.stats() and plain.stats()["violations"] > 0


def test_replayed_steps_find_what_launching_every_kernel_finds() -> None:
    plain = manager()
    want = run(plain, 12, fault_at=7, static=True)
    mgr = manager()
    log = with_fake_graphs(mgr)
    got = run(mgr, 12, fault_at=7, static=True)
    assert log.count("replay") >= 8
    assert mgr.stats() == plain.stats() and mgr.stats()["violations"] > 0
    assert mgr.health_failure_counts() == {"kernels_ran": 0, "phase": 0}

    def found(rs: list[StepReport | None]) -> list[tuple[int, int, tuple[object, ...], int]]:
        return [(r.step, r.reported_at, r.affected_request_ids, r.total) for r in rs if r is not None]

    assert found(got) == found(want)


def test_fresh_tensors_every_step_never_replay() -> None:
    mgr = manager()
    log = with_fake_graphs(mgr)
    run(mgr, 5, None, static=False)
    assert "replay" not in log


def test_a_replayed_step_is_neither_validated_nor_launched_kernel_by_kernel(
    counted: collections.Counter[str],
) -> None:
    mgr = manager(Backend.TRITON)
    replays: list[str] = []
    mgr._graphs = StepGraphs(lambda work: FakeGraphNoRun(replays))
    keep = StaticBatch()
    wl = Workload()
    keys = []
    for k in range(4):
        batch = keep(wl.batch([(1, 4 if k == 0 else 1)], truth=True))
        keys.append(batch_key([batch]))
        counted.clear()
        mgr.forward_step({"full": batch})
        mgr.host_step(["a"])
    assert keys[1] == keys[2] == keys[3] != keys[0]
    assert replays == ["replay"] and counted == {}  # step 3: one replay, no validation, no launch


class LoggedPrelude:
    """An adapter's device work ahead of the step (the transformers translation), logged when it runs."""

    def __init__(self, key: str, log: list[str]) -> None:
        self._key, self._log = key, log

    @property
    def key(self) -> tuple[object, ...]:
        return (self._key,)

    def run(self) -> None:
        self._log.append(f"prelude {self._key}")


def test_a_prelude_runs_before_the_canary_work_and_joins_its_graph_and_key() -> None:
    mgr = manager()
    log = with_fake_graphs(mgr)
    before = mgr._work.before
    mgr._work.before = lambda ordered: (log.append("canary"), before(ordered))[1]  # type: ignore[method-assign]
    keep, wl = StaticBatch(), Workload()
    for k, prelude_key in enumerate("aaaab"):
        batch = keep(wl.batch([(1, 4 if k == 0 else 1)], truth=True))
        mgr.forward_step({"full": batch}, LoggedPrelude(prelude_key, log))
        mgr.host_step(["a"])
    # steps 1-3 share the batch key: seen at 1, captured at 2 (with its prelude), replayed at 3; step 4's
    # prelude has another key, so the same batch tensors run eagerly
    eager = ["prelude a", "canary"]
    assert log == [*eager, *eager, *eager, "capture", "replay", *eager, "prelude b", "canary"]


class FakeGraphNoRun:
    def __init__(self, log: list[str]) -> None:
        self._log = log

    def replay(self) -> None:
        self._log.append("replay")


def test_seen_keys_and_graphs_are_bounded() -> None:
    made: list[Any] = []
    graphs = StepGraphs(lambda work: made.append(work) or FakeGraphNoRun([]), max_graphs=2)
    for key in range(5):
        graphs.ran_eagerly((key,), lambda: None)
        graphs.ran_eagerly((key,), lambda: None)
    assert len(made) == 5 and graphs.captures == 5
    assert not graphs.replay((0,)) and graphs.replay((4,)) and graphs.replay((3,))


def test_captures_after_a_clear_come_from_a_renewed_factory() -> None:
    made: list[str] = []

    def factory(tag: str) -> Callable[[Callable[[], None]], FakeGraph]:
        return lambda work: (made.append(tag), FakeGraph(work, []))[1]

    renewals = iter("bc")
    graphs = StepGraphs(factory("a"), first_sight=True, renew=lambda: factory(next(renewals)))
    graphs.ran_eagerly((1,), lambda: None)
    graphs.clear()
    assert not graphs.replay((1,))  # cleared
    graphs.ran_eagerly((1,), lambda: None)
    graphs.ran_eagerly((2,), lambda: None)
    assert made == ["a", "b", "b"] and graphs.replay((1,)) and graphs.replay((2,))


@pytest.mark.gpu
def test_cuda_step_graphs_match_eager_launches() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    eager = manager(Backend.TRITON, "cuda")
    eager._graphs = None
    want = run_cuda(eager, 20, fault_at=11)
    mgr = manager(Backend.TRITON, "cuda")
    got = run_cuda(mgr, 20, fault_at=11)
    assert mgr.graph_stats()["graph_replays"] >= 15
    assert mgr.stats() == eager.stats() and mgr.stats()["violations"] > 0
    assert mgr.health_failure_counts() == {"kernels_ran": 0, "phase": 0}
    assert [(r.step, r.total, r.affected_request_ids) for r in got if r is not None] == [
        (r.step, r.total, r.affected_request_ids) for r in want if r is not None
    ]


@pytest.mark.gpu
def test_cuda_step_graphs_captured_at_first_sight_and_again_after_a_clear_match_eager_launches() -> None:
    """A manager with static batches captures at a key's first sight; clearing its graphs (as attaching digests
    does) and capturing again works on a fresh pool (torch refuses a pool whose graphs were all freed)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    eager = manager(Backend.TRITON, "cuda")
    eager._graphs = None
    want = run_cuda(eager, 20, fault_at=11)
    group = CanaryGroup(num_slots=NUM_SLOTS, name="full")
    mgr = CanaryManager([group], CAPS, CanaryConfig(mode=Mode.LOG), device="cuda", static_batches=True)
    graphs = mgr._graphs
    got = run_cuda(mgr, 20, fault_at=11, clear_at=8)
    # steps 0 (the prefill) and 1 (the first decode) were captured before they ran and replayed; 2..7 replayed; the
    # clear at 8: step 8 was captured again (on a new pool) and replayed, 9..19 replayed
    assert mgr._graphs is graphs is not None
    assert {k: v for k, v in graphs.stats().items() if not k.endswith("_us")} == {
        "graph_replays": 20, "graph_captures": 3, "graph_eager_steps": 0, "graph_capture_failures": 0,
    }  # fmt: skip
    assert mgr.stats() == eager.stats()
    assert mgr.stats()["violations"] > 0 and mgr.health_failure_counts() == {"kernels_ran": 0, "phase": 0}
    assert [(r.step, r.total, r.affected_request_ids) for r in got if r is not None] == [
        (r.step, r.total, r.affected_request_ids) for r in want if r is not None
    ]


def run_cuda(mgr: CanaryManager, steps: int, fault_at: int, clear_at: int | None = None) -> list[StepReport | None]:
    wl, keep = Workload(), StaticBatch()
    table = wl.table.cuda()
    out = []
    for k in range(steps):
        if k == clear_at and mgr._graphs is not None:
            mgr._graphs.clear()
        if k == fault_at:
            alias_first_slot(wl, victim=2, owner=1)
        batch = wl.batch([(1, 4 if k == 0 else 1), (2, 4 if k == 0 else 1)], truth=True)
        table.copy_(wl.table)
        fields = {n: (table if n == "table" else None if t is None else t.cuda()) for n, t in batch.tensors().items()}
        mgr.forward_step({"full": keep(StepBatch(**fields))})
        out.append(mgr.host_step(["req-a", "req-b"]))
    out.append(mgr.flush())
    return out


def test_remembered_keys_are_the_batch_keys_and_follow_new_tensors() -> None:
    keys = BatchKeys(limit=2)
    wl = Workload()
    batch = wl.batch([(1, 4)], truth=True)
    assert keys([batch]) == batch_key([batch])
    assert keys([batch]) is keys([batch])  # the same tensors: remembered, no tensor call
    moved = dataclasses.replace(batch, rows=batch.rows.clone())  # one new tensor (another address)
    assert keys([moved]) == batch_key([moved]) != batch_key([batch])
    other = wl.batch([(1, 1)], truth=True)
    keys([other])  # the limit: the oldest entry goes
    assert keys([batch]) == batch_key([batch])  # recomputed: still right


@compiled_build.patches("kvcanary.runtime.step_graphs")
def test_the_same_batches_and_prelude_handed_again_reuse_the_last_key_and_replay() -> None:
    """An adapter's steady step hands the last step's mapping and prelude objects again: no key is recomputed."""
    mgr = manager()
    log = with_fake_graphs(mgr)
    computed: list[int] = []
    inner = mgr._step_keys._batch_keys
    mgr._step_keys._batch_keys = lambda ordered: (computed.append(1), inner(ordered))[1]  # type: ignore[assignment]
    keep, wl = StaticBatch(), Workload()
    batches = {"full": keep(wl.batch([(1, 4)], truth=True))}
    prelude = LoggedPrelude("a", log)
    for _ in range(4):
        mgr.forward_step(batches, prelude)
        mgr.host_step(["a"])
    assert len(computed) == 1 and log.count("replay") == 2  # seen, captured, replayed twice: one key
    mgr.forward_step(dict(batches), prelude)  # equal contents, another mapping: its key is computed, and equal
    mgr.host_step(["a"])
    assert len(computed) == 2 and log.count("replay") == 3
    mgr.forward_step(batches, LoggedPrelude("b", log))  # another prelude: another key, run eagerly
    mgr.host_step(["a"])
    assert len(computed) == 3 and log.count("replay") == 3


def test_a_hashed_key_equals_only_an_equal_key() -> None:
    a, b = HashedKey((1, (2, "x"))), HashedKey((1, (2, "x")))
    assert a == b and hash(a) == hash(b) == hash((1, (2, "x"))) and a != HashedKey((1, (2, "y")))
    assert a != (1, (2, "x"))  # the graphs hold one kind of key: a wrapped one never matches a bare tuple


def test_the_mappings_of_every_kept_steady_translation_keep_their_keys() -> None:
    """The transformers adapter keeps a translation per shape class and engine buffer set (up to 8 x 4); a loop
    cycling through that many mappings computes each one's key once, not again after every few others."""
    from kvcanary.adapters.transformers_cb.steady_step import MAX_BUFFER_SETS, MAX_CLASSES
    from kvcanary.runtime.step_graphs import StepKeys

    ordered: list[int] = []
    keys = StepKeys(lambda batches: (ordered.append(1), list(batches.values()))[1])
    wl = Workload()
    batch = wl.batch([(1, 4)], truth=True)
    mappings = [{"full": batch} for _ in range(MAX_CLASSES * MAX_BUFFER_SETS)]
    for _ in range(3):
        for m in mappings:
            keys(m, None)
    assert len(ordered) == len(mappings)
