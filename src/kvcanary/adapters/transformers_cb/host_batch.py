"""What the scheduler believes about one step, captured on the host when the batch is prepared.

``ContinuousBatchingIOs.prepare_batch_tensors`` advances each request's ``position_offset``, so the
past lengths are read just before it runs.  Ground truth is the request's prompt plus its generated
tokens; in asynchronous batching the token being carried over is not known yet and stays unchecked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

from kvcanary.schema import UNKNOWN_TOKEN

REFRESH = 32  # the truth store's compare window: positions before a request's newest sent token (see truth_store)
_TAIL = 2 * REFRESH  # History.TAIL, as a module constant for its initialiser (no class attribute lookup)
WARMUP_PREFIX = "__warmup_"  # request ids of transformers' warm-up batches (fake requests, never-written KV)
_WARMUP_LEN = len(WARMUP_PREFIX)


class History(Sequence[int]):
    """A request's token history (prompt, then generated tokens) as the scheduler held it at capture, read
    without copying it: copying every request's history each step cost time in proportion to the whole
    context (issue 14).  Its length is fixed at capture; the newest ``keep`` tokens are copied then, so
    a rewind or rewrite of the newest tokens after capture does not change what this step claims.  Older
    positions are read from the engine's lists when asked (they only ever grow at the end); a position the
    engine no longer holds reads as the unknown token (not checked).

    The capture keeps :data:`REFRESH` plus the step's query length: what the truth store compares and sends for
    a request that was sent up to this step's query (the usual step), and no more: each token copied is a Python
    object touched, cold in a serving loop (the CPU cold proxy moved by about 1 us on the hybrid demo, so the
    tail is not what a batch row's cost is).  Built by hand (tests, benchmarks), a history keeps :data:`TAIL`.
    """

    TAIL: ClassVar[int] = _TAIL  # twice the truth store's refresh window

    __slots__ = ("_generated", "_initial", "size", "tail", "tail_start")

    def __init__(self, initial: Sequence[int], generated: Sequence[int], keep: int = _TAIL) -> None:
        self._initial, self._generated = initial, generated
        # Public for the truth store's per-row loop (attribute reads, not calls): the length and the tail's copy.
        # Built once per request and step, cold: no calls beyond the slices (each a copy already for a list).
        k = len(initial)
        self.size = n = k + len(generated)
        self.tail_start = start = n - keep if n > keep else 0
        if start >= k:
            tail = generated[start - k :]
        else:  # a list's slice is a new list already: extended in place, not copied again
            joined: list[int] = initial[start:] if type(initial) is list else list(initial[start:])
            joined += generated
            tail = joined
        self.tail = tail if type(tail) is list else list(tail)

    def __len__(self) -> int:
        return self.size

    def tokens(self, start: int, stop: int) -> list[int]:
        """Tokens ``[start, stop)`` (clamped to the history)."""
        start, stop = max(0, start), min(stop, self.size)
        if start >= stop:
            return []
        if start >= self.tail_start:
            return self.tail[start - self.tail_start : stop - self.tail_start]
        k = len(self._initial)
        old = self.tail_start if stop > self.tail_start else stop
        head = list(self._initial[start : min(old, k)])
        if old > k:
            head += self._generated[max(start, k) - k : old - k]
        head += [UNKNOWN_TOKEN] * (old - start - len(head))  # the engine dropped some: unknown
        return head + self.tail[: max(0, stop - self.tail_start)]

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self.tokens(0, self.size)[index]
        i = index + self.size if index < 0 else index
        if not 0 <= i < self.size:
            raise IndexError(f"history index {index} out of range for length {self.size}")
        return self.tokens(i, i + 1)[0]


@dataclasses.dataclass(slots=True)  # not frozen (treated as immutable): built every step, cold, where a frozen
class HostBatch:  # dataclass's initialiser takes a path nothing else on the step touches
    request_ids: tuple[str, ...]
    past_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    truth: tuple[Sequence[int], ...]  # per request: the token ids the scheduler believes are at 0, 1, ...
    histories: bool = False  # every truth entry is a History (the engine capture): taken as it is by the truth store

    @classmethod
    def from_future_states(cls, future_states: Sequence[Any]) -> HostBatch:
        ids, past, query, truth = [], [], [], []
        for fs in future_states:  # per request, every step, cold: the engine's lengths are ints already (no int())
            state = fs.state
            ids.append(str(state.request_id))
            past.append(state.position_offset)
            q = fs.query_length
            query.append(q)
            truth.append(History(state.initial_tokens, state.generated_tokens, REFRESH + q))
        return cls(tuple(ids), tuple(past), tuple(query), tuple(truth), True)

    @property
    def batch_size(self) -> int:
        return len(self.request_ids)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def is_warmup(self) -> bool:
        """A batch of transformers' warm-up requests (fake ones, whose KV is never written).  The engine builds those
        batches of warm-up requests only, so the first id tells: one slice compared, not a scan of every row with
        a method call each (this runs on every step with the CPU caches cold: 6-11 us against about 4 measured)."""
        ids = self.request_ids
        return bool(ids) and ids[0][:_WARMUP_LEN] == WARMUP_PREFIX
