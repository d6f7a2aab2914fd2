"""A step's batch padded to a shape class, so that the canary's step graphs replay.

A CUDA graph of the canary's step bakes in the shapes of the batch tensors (see
:mod:`kvcanary.runtime.step_graphs`): how many batch rows and forward tokens.  An engine's steps vary in
both (the GPU demo's dense run: 44 (rows, tokens) pairs in 720 steps, and with the truth writes in the key
too, 130 steps ran eagerly, each paying several Triton launches of host time).  Rounded up (rows to powers of two,
tokens to powers of four: :data:`TOKEN_GROWTH`), at least :data:`SMALLEST` and at most the capacities, they fall
into a few classes.  The padding is inert:
a padding row has the padding row's table row (0) and no lengths, and a padding token lies past every row's
writes (its ``out_cache_loc`` is ``NOT_STORED``); the kernels skip both at no measurable cost.  (The truth's
writes stay out of the graph: see :meth:`~kvcanary.adapters.transformers_cb.truth_store.TruthStore.deferred`.)
"""

from __future__ import annotations

import array
import dataclasses
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any, Generic, TypeVar

import torch

from kvcanary.adapters.transformers_cb.host_batch import HostBatch

V = TypeVar("V")

# The smallest class: every step of up to 16 rows or tokens shares one shape (the small decode batches of a
# serving loop, one graph for all of them).
SMALLEST = 16


def forward_tokens(kwargs: Mapping[str, Any], host: HostBatch, max_batch: int) -> tuple[int, bool]:
    """The forward's token count and whether the engine padded the batch, once the inputs agree."""
    b, n_tok = host.batch_size, int(kwargs["input_ids"].numel())
    if b > max_batch:
        raise ValueError(f"batch has {b} requests, more than max_batch={max_batch}")
    if host.num_tokens > n_tok:
        raise RuntimeError(
            f"the scheduler planned {host.num_tokens} query tokens but the forward received {n_tok}: "
            "the host batch and the forward kwargs are out of step"
        )
    return n_tok, forward_padded(kwargs, b, n_tok, host.num_tokens)


def forward_padded(kwargs: Mapping[str, Any], rows: int, n_tok: int, n_query: int) -> bool:
    """Whether the engine padded the forward: more tokens than the ``n_query`` planned, or more query rows than the
    batch's ``rows``."""
    cu_q = kwargs.get("cu_seq_lens_q")
    return n_tok > n_query or (cu_q is not None and cu_q.numel() > rows + 1)


# Token classes grow fourfold (16, 64, 256, ...): each class a loop meets costs the canary a full step (a full
# translation, an eager step and a capture: about 3 ms of host time on the GPU demo), while a padding token costs its
# kernels next to nothing.  Rows stay at powers of two (a batch's rows change one request at a time).
TOKEN_GROWTH = 4


def bucket(n: int, cap: int, growth: int = 2) -> int:
    """``n`` rounded up to :data:`SMALLEST` times a power of ``growth`` (a power of two), at most ``cap`` (``n``
    itself when it is 0 or already past ``cap``)."""
    if n <= 0 or n >= cap:
        return n
    c = SMALLEST
    while c < n:
        c *= growth
    return min(c, cap)


def bucket_tokens(n_tok: int, cap: int) -> int:
    """A step's forward tokens rounded up to their class (:data:`TOKEN_GROWTH`)."""
    return bucket(n_tok, cap, TOKEN_GROWTH)


def shape_class(b: int, n_tok: int, max_batch: int, max_tokens: int) -> tuple[int, int]:
    """A step's rows and tokens rounded up to its class (the tokens within ``max_tokens``, 0: not capped below)."""
    return bucket(b, max_batch), bucket_tokens(n_tok, max(max_tokens, n_tok))


class ShapeClasses:
    """:func:`shape_class` remembered per step shape and bucketing settings: one dict lookup a step and no calls (a
    steady step runs with the caches cold, see :func:`pad_rows`).  Bounded: cleared when ``limit`` are held."""

    def __init__(self, max_batch: int, limit: int = 4096) -> None:
        self._max_batch = max_batch
        self._classes: dict[tuple[int, int, bool, int], tuple[int, int]] = {}
        self._limit = limit

    def of(self, b: int, n_tok: int, bucketed: bool, max_tokens: int) -> tuple[int, int]:
        """The rows and tokens of a step's batch tensors: rounded up to a class when ``bucketed``, else as they are."""
        key = (b, n_tok, bucketed, max_tokens)
        got = self._classes.get(key)
        if got is None:
            if len(self._classes) >= self._limit:
                self._classes.clear()
            got = shape_class(b, n_tok, self._max_batch, max_tokens) if bucketed else (b, n_tok)
            self._classes[key] = got
        return got


def pad_rows(values: Iterable[int], n: int) -> array.array[int]:
    """``values`` as int64, with zeros appended up to ``n`` entries.  A step's per-row arrays are built this
    way, in plain Python, not with numpy: the canary's step runs between two forwards of the model, with
    every cache cold, and there each distinct numpy function costs tens of microseconds on first touch."""
    out = array.array("q", values)
    if len(out) < n:
        out.frombytes(bytes(8 * (n - len(out))))
    return out


class RecurringViews(Generic[V]):
    """Views handed out again while their key recurs: a step's shapes come from a few classes, and slicing a
    tensor is a torch call, microseconds of host time each step.  Bounded: cleared when ``limit`` are held."""

    def __init__(self, limit: int = 1024) -> None:
        self._views: dict[Hashable, V] = {}
        self._limit = limit

    def get(self, key: Hashable, make: Callable[[], V]) -> V:
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= self._limit:
                self._views.clear()
            view = self._views[key] = make()
        return view

    def find(self, key: Hashable) -> V | None:
        """The view held for ``key``, if any (no factory to build: the hot path's lookup)."""
        return self._views.get(key)

    def clear(self) -> None:
        self._views.clear()


def flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as one dimension: itself when it is one already (the engine's index tensors), so the step pays no
    view op for it (each torch call costs host time; see :mod:`kvcanary.runtime.cuda_calls`)."""
    return t if t.dim() == 1 else t.reshape(-1)


def widen(t: torch.Tensor, n: int) -> torch.Tensor | None:
    """The contiguous ``t`` (an engine's token tensor, ``(T,)`` or ``(1, T)``) as a 1-D view of its first ``n``
    storage elements from where it starts, in one view op (none when it is one dimension of ``n`` already); None
    when the storage is shorter (an engine's static input buffers hold the largest batch) or ``t`` is not
    contiguous."""
    if int(t.numel()) == n:
        return flat(t)
    if not t.is_contiguous() or t.storage_offset() + n > t.untyped_storage().nbytes() // t.element_size():
        return None
    return t.as_strided((n,), (1,))


@dataclasses.dataclass(frozen=True)
class StepShape:
    """The step's batch rows and its forward's token tensors, padded or as they are."""

    rows: int
    input_ids: torch.Tensor
    positions: torch.Tensor

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def padded(
        cls, rows: int, input_ids: torch.Tensor, positions: torch.Tensor, max_batch: int, max_tokens: int
    ) -> StepShape:
        """Rows and tokens rounded up (see :func:`bucket`), the engine's token tensors viewed as one dimension; the
        tokens stay as they are (flattened) when the engine's buffers are too short to view more of."""
        want = bucket_tokens(int(input_ids.numel()), max_tokens)
        ids, pos = widen(input_ids, want), widen(positions, want)
        if ids is None or pos is None:
            ids, pos = flat(input_ids), flat(positions)
        return cls(bucket(rows, max_batch), ids, pos)
