"""The canary's own CUDA graphs of one step's device work, for engines that run eagerly.

An adapter whose tap runs after the engine enqueued the forward (transformers) calls
``before_forward`` and ``after_forward`` back to back.  Eagerly that is every group's plan, verify and
stamp launches plus the phase marks and the log snapshot: a few Triton launches per group, each tens of
microseconds of Python on the host, for 10-20 us of device work.  :class:`StepGraphs` captures that
work once and replays it in one launch.

A graph bakes in its kernels' arguments: the batch tensors' addresses and shapes, and the sizes and
flags derived from them.  So a step's batches are keyed by the (address, shape, stride, dtype) of every
tensor in them; a step whose key was captured replays the graph -- the same launches an eager run would
issue, reading whatever the tensors hold now -- and validation, already passed by the captured step's
identical metadata, is not repeated.  By default a key is captured the second time it is seen, after that step ran
eagerly, since an adapter that hands in fresh tensors sees most keys once (prefill chunks).  With ``first_sight``,
for an adapter whose batch tensors are static buffers from a bounded set of shapes (the transformers translator's
shape classes), a key is captured the first time it is seen, before it has run, and replayed at once: a new key
costs one capture and no eager run (on the GPU demo's hybrid model each new key cost an eager step of about 1.8 ms
and a capture of as much, three keys a run of 352 steps).  A kernel not compiled yet compiles inside the capture
(drivers since CUDA 12.3 load modules during a capture); a capture that fails anyway runs the step eagerly and
captures it after, as before.  At most :data:`MAX_GRAPHS` are kept, least recently used evicted.  Adapters raise
the hit rate by keeping the batch tensors at stable addresses (static buffers, the engine's own).

An adapter may hand in a :class:`Prelude`: device work of its own that fills the step's batches (the
transformers translation).  It runs first, joins the graph, and its key joins the step's.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Protocol

import torch

from kvcanary.batch import StepBatch
from kvcanary.runtime.cuda_calls import CudaCalls

logger = logging.getLogger("kvcanary")

MAX_GRAPHS = 64
MAX_SEEN = 4096  # keys seen once and remembered (bounded state)

Key = tuple[object, ...]


class Graph(Protocol):
    def replay(self) -> None: ...


GraphFactory = Callable[[Callable[[], None]], Graph]


class Prelude(Protocol):
    """Device work of the adapter's own that a step's canary work reads (its translation), run first and
    captured into the same graph; ``key`` names every address, size and flag the work bakes in."""

    @property
    def key(self) -> Key: ...

    def run(self) -> None: ...


def batch_key(batches: Sequence[StepBatch]) -> Key:
    """Every tensor of the step's batches, by (address, shape, stride, dtype); None where absent."""
    out: list[object] = []
    for b in batches:
        for t in _fields(b):
            out.append(None if t is None else (t.data_ptr(), t.shape, t.stride(), t.dtype))
    return tuple(out)


class HashedKey:
    """A step key with its hash computed once: the key (a few hundred nested items) is looked up every step, and a
    tuple recomputes its hash on each lookup.  Wrappers of equal keys are equal (and never equal a bare tuple)."""

    __slots__ = ("_hash", "key")

    def __init__(self, key: Key) -> None:
        self.key = key
        self._hash = hash(key)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, HashedKey) and self._hash == other._hash and self.key == other.key)


class BatchKeys:
    """:func:`batch_key` remembered by the identity of the batches' tensors: an adapter whose batch tensors are the
    same objects step after step (the transformers adapter's recurring views) then pays no tensor call for the key,
    each a cold path in a serving loop.  Sound while a remembered tensor keeps its metadata: the tensors are held
    (so no other object takes their ids), and adapters make new views rather than resize one in place."""

    def __init__(self, limit: int = 256) -> None:
        self._keys: collections.OrderedDict[tuple[int, ...], tuple[Key, tuple[object, ...]]] = collections.OrderedDict()
        self._limit = limit

    def __call__(self, batches: Sequence[StepBatch]) -> Key:
        held = tuple(t for b in batches for t in _fields(b))
        ids = tuple(map(id, held))
        hit = self._keys.get(ids)
        if hit is not None:
            return hit[0]
        key = batch_key(batches)
        self._keys[ids] = (key, held)
        if len(self._keys) > self._limit:
            self._keys.popitem(last=False)
        return key


class StepKeys:
    """A step's batches in group order and its graph key (with the prelude's), remembered twice over: by the
    identity of the batch tensors (:class:`BatchKeys`), and by the identity of the ``batches`` mapping and prelude
    that an adapter hands again unchanged (the transformers adapter's steady steps: one per shape class and engine
    buffer set, up to 32; the limit leaves room for the full steps' new mappings between two clears).  The mappings
    and preludes are held, so their ids stay theirs."""

    def __init__(self, order: Callable[[Mapping[str, StepBatch]], list[StepBatch]], limit: int = 64) -> None:
        self._order = order
        self._batch_keys = BatchKeys()
        self._known: dict[tuple[int, int], tuple[object, object, list[StepBatch], HashedKey]] = {}
        self._limit = limit

    def __call__(self, batches: Mapping[str, StepBatch], prelude: Prelude | None) -> tuple[list[StepBatch], HashedKey]:
        known = self._known.get((id(batches), id(prelude)))
        if known is not None:
            return known[2], known[3]
        ordered = self._order(batches)
        raw = self._batch_keys(ordered)
        key = HashedKey(raw if prelude is None else (prelude.key, *raw))
        if len(self._known) >= self._limit:
            self._known.clear()
        self._known[id(batches), id(prelude)] = (batches, prelude, ordered, key)
        return ordered, key


def _fields(b: StepBatch) -> tuple[torch.Tensor | None, ...]:
    return (b.rows, b.prefix_lens, b.extend_lens, b.table, b.input_ids, b.positions, b.out_cache_loc, b.truth,
            b.truth_lens, b.lookup)  # fmt: skip


class StepGraphs:
    """Captured step graphs by key (see the module docstring); ``factory`` captures ``work`` into a graph."""

    def __init__(
        self, factory: GraphFactory, max_graphs: int = MAX_GRAPHS, *, first_sight: bool = False,
        renew: Callable[[], GraphFactory] | None = None,
    ) -> None:  # fmt: skip
        """``renew``: a new factory for the captures after :meth:`clear` (the CUDA graphs' memory pool: torch refuses
        to capture into a pool whose graphs were all freed)."""
        self._factory = factory
        self._renew = renew
        self._max = max_graphs
        self._first_sight = first_sight  # capture after a key's first eager step, not its second
        self._graphs: collections.OrderedDict[Hashable, Graph] = collections.OrderedDict()
        self._seen: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
        self.replays = 0
        self.captures = 0
        self.capture_ns = 0  # host time in captures
        self.eager_steps = 0  # steps that ran eagerly (every step whose key has no graph yet)
        self.eager_ns = 0  # their host time, captures left out
        self.capture_failures = 0  # captures at first sight that failed (those steps ran eagerly)

    def replay(self, key: Hashable) -> bool:
        """Replay the graph captured for ``key``; False (nothing run) when there is none."""
        graph = self._graphs.get(key)
        if graph is None:
            return False
        self._graphs.move_to_end(key)
        graph.replay()
        self.replays += 1
        return True

    @property
    def first_sight(self) -> bool:
        return self._first_sight

    def capture_and_replay(self, key: Hashable, work: Callable[[], None]) -> bool:
        """A key seen for the first time, with ``first_sight``: capture ``work`` and replay it, so the step runs from
        its graph at once, with no eager run before the capture (what a new shape class cost twice: each kernel's
        launch path in Python, then again under capture).  False, with nothing run, when the capture failed (the
        caller runs the step eagerly, and :meth:`ran_eagerly` captures it again after)."""
        start = time.perf_counter_ns()
        try:
            graph = self._factory(work)
        except Exception:
            self.capture_failures += 1
            if self.capture_failures == 1:  # each later one is counted (graph_capture_failures), not logged
                logger.warning(
                    "kvcanary: capturing the canary's step graph failed; the step runs eagerly and is captured after",
                    exc_info=True,
                )
            return False
        self._keep(key, graph, start)
        graph.replay()
        self.replays += 1
        return True

    def ran_eagerly(self, key: Hashable, work: Callable[[], None], started_ns: int | None = None) -> None:
        """``key``'s step just ran eagerly (from ``started_ns``, a ``perf_counter_ns`` reading, when given): capture
        ``work`` for it if it was seen before (at once with ``first_sight``)."""
        self.eager_steps += 1
        if started_ns is not None:
            self.eager_ns += time.perf_counter_ns() - started_ns
        if not self._first_sight:
            if key not in self._seen:
                self._seen[key] = None
                if len(self._seen) > MAX_SEEN:
                    self._seen.popitem(last=False)
                return
            del self._seen[key]
        start = time.perf_counter_ns()
        self._keep(key, self._factory(work), start)

    def _keep(self, key: Hashable, graph: Graph, started_ns: int) -> None:
        """``graph`` captured for ``key`` from ``started_ns``: kept (the least recently used dropped past the limit)."""
        self._graphs[key] = graph
        self.capture_ns += time.perf_counter_ns() - started_ns
        self.captures += 1
        if len(self._graphs) > self._max:
            self._graphs.popitem(last=False)

    def clear(self) -> None:
        self._graphs.clear()
        self._seen.clear()
        if self._renew is not None:
            self._factory = self._renew()

    def stats(self) -> dict[str, int]:
        """Steps replayed, graphs captured and steps run eagerly, with the host time of the captures and of the eager
        steps (where a steady serving loop's mean time in the canary's launches goes: replays are cheap), and the
        captures at first sight that failed."""
        counts = (
            self.replays, self.captures, self.capture_ns // 1000, self.eager_steps, self.eager_ns // 1000,
            self.capture_failures,
        )  # fmt: skip
        return dict(zip(GRAPH_STAT_KEYS, counts, strict=True))


GRAPH_STAT_KEYS = (
    "graph_replays", "graph_captures", "graph_capture_us", "graph_eager_steps", "graph_eager_us",
    "graph_capture_failures",
)  # fmt: skip


class CudaStepGraph:
    """``work`` captured on a side stream (ordered after the current one), replayed on the current stream.

    Capture records and does not run the work: the caller ran this step eagerly already, or replays the graph next.
    The capture mode is thread-local: the engine may use CUDA from other threads meanwhile.
    """

    def __init__(self, work: Callable[[], None], pool: Any, calls: CudaCalls) -> None:
        self._graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(current)
        with torch.cuda.stream(side):
            self._graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                work()
            finally:
                self._graph.capture_end()
        current.wait_stream(side)
        # The launch itself as the replay (no method around it: one Python call fewer on every step).
        self.replay: Callable[[], None] = calls.graph_launch(self._graph)


def cuda_step_graphs(*, first_sight: bool = False) -> StepGraphs:
    calls = CudaCalls(torch.cuda.current_device())

    def factory() -> GraphFactory:
        pool = torch.cuda.graph_pool_handle()  # one pool for every graph until the next clear()
        return lambda work: CudaStepGraph(work, pool, calls)

    return StepGraphs(factory(), first_sight=first_sight, renew=factory)
