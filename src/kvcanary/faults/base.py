"""What a fault is: a documented corruption of the engine's own state, and the context it acts through.

A fault is written against the *engine* (its allocator, block tables, the index tensors it builds, its
block copies, offload restore, sampled token ids, the KV bytes), never against the canary: the canary must
find out by itself.  Each fault class carries a :class:`FaultSpec` -- the bug class it models, an example
issue of that class in a real engine's tracker, whether the canary is expected
to detect it and by which check, or why it cannot.

Injection is two-phase so that the injected step is a *random eligible* one: on the clean control run every
fault only *probes* (its hooks call :meth:`FaultContext.take`, which records the step as an opportunity and
returns False); the faulted run, identical to the control up to that point (same seed, deterministic
engine), gets one recorded step as its target and :meth:`FaultContext.take` returns True there, once.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from kvcanary.adapters.transformers_cb.adapter import TransformersCBAdapter
    from kvcanary.adapters.transformers_cb.host_batch import HostBatch

FULL = "full_attention"
SLIDING = "sliding_attention"


class Expect(enum.StrEnum):
    DETECT = "detect"
    MISS = "miss"


@dataclasses.dataclass(frozen=True)
class FaultSpec:
    name: str
    bug_class: str  # short: what goes wrong, in the catalogue's vocabulary
    catalogue: str  # the real bug(s) it models: engine and example issue(s)
    mechanism: str  # what the fault does to the engine, one sentence
    model: str  # workload model kind: "dense" (full attention) or "hybrid" (sliding + full)
    expected: Expect
    check: str  # the check expected to fire ("phase: reason/reason"), or "none"
    checks: frozenset[tuple[str, str]] = frozenset()  # (phase, reason) pairs that count as the expected check
    why_miss: str = ""  # for Expect.MISS: why the token/position/link checks cannot see it


class InjectMode(enum.Enum):
    PROBE = "probe"  # record opportunities, change nothing (the clean control)
    INJECT = "inject"  # corrupt once, at the first opportunity at or after the target step


@dataclasses.dataclass
class Injection:
    step: int  # canary step label when the corruption happened (the next forward's step between steps)
    detail: str
    requests: tuple[str, ...]  # the requests whose KV or mapping was corrupted (for attribution)


class FaultContext:
    """Everything a fault's hooks may touch during one run of the engine.

    Engine objects (``processor``, ``cache``, ``scheduler``, ``offloading``) are bound when the
    engine's batch processor is first seen, before its first step.  ``step`` is the canary step the next
    (or current) forward gets; ``host`` is the host batch of the step being prepared or run.
    """

    def __init__(
        self,
        adapter: TransformersCBAdapter,
        mode: InjectMode,
        *,
        rng: random.Random,
        target: tuple[str, int] | None = None,
        page_size: int,
    ) -> None:
        if mode is InjectMode.INJECT and target is None:
            raise ValueError("inject mode needs a target (fault name, step)")
        self.adapter = adapter
        self.mode = mode
        self.rng = rng
        self.target = target
        self.page_size = page_size
        self.opportunities: dict[str, list[int]] = {}
        self.injection: Injection | None = None
        self.errors: list[BaseException] = []
        self.processor: Any = None
        self.stop_requested = False
        self.request_stop: Callable[[], None] = lambda: None  # set by the harness: end the run early
        self._forward_hooks: list[Callable[[dict[str, Any]], None]] = []
        self._after_update_hooks: list[Callable[[], None]] = []

    # ------------------------------------------------------------------ engine objects

    @property
    def cache(self) -> Any:
        return self.processor.cache

    @property
    def scheduler(self) -> Any:
        return self.processor.scheduler

    @property
    def offloading(self) -> Any:
        return self.processor.offloading_manager

    def allocator(self, group: str) -> Any | None:
        return self.cache.cache_allocators.get(group)

    def group_index(self, group: str) -> int:
        return list(self.cache.cache_allocators).index(group)

    @property
    def step(self) -> int:
        return self.adapter.next_step

    @property
    def host(self) -> HostBatch | None:
        return self.adapter.pending_batch

    def state(self, request_id: str) -> Any | None:
        sched = self.scheduler
        return sched.active_requests.get(request_id) or sched.waiting_requests.get(request_id)

    def remaining(self, request_id: str) -> int:
        """Tokens the request still has to generate (0 when unknown or finished)."""
        s = self.state(request_id)
        if s is None or s.max_new_tokens is None:
            return 0
        return int(s.max_new_tokens) - len(s.generated_tokens)

    # ------------------------------------------------------------------ probe / inject

    def take(self, name: str) -> bool:
        """Called by a fault's hook where it *could* corrupt now.  Probe: note the step, return False.
        Inject: True once, for the target fault at or after its target step."""
        if self.injection is not None and self.mode is InjectMode.INJECT:
            return False
        if self.mode is InjectMode.PROBE:
            steps = self.opportunities.setdefault(name, [])
            if not steps or steps[-1] != self.step:
                steps.append(self.step)
            return False
        return self.target is not None and name == self.target[0] and self.step >= self.target[1]

    def injected(self, detail: str, requests: Sequence[str] = ()) -> None:
        self.injection = Injection(self.step, detail, tuple(requests))

    # ------------------------------------------------------------------ hooks

    def guard(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Run ``fn``; an exception of the fault's own code is recorded (the trial errors) instead of
        reaching the engine, which would fail every request."""

        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except Exception as exc:  # recorded and reported as a harness error, never swallowed silently
                self.errors.append(exc)
                return None

        return guarded

    def wrap(self, obj: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        """Replace ``obj.name`` on this object only (engine objects live for one run).  ``make`` gets the
        current bound callable -- the class's, so the adapter's class-level wrappers still run inside."""
        setattr(obj, name, make(getattr(obj, name)))

    def on_forward(self, hook: Callable[[dict[str, Any]], None]) -> None:
        """``hook(kwargs)`` runs before each paged forward (the kwargs are the engine's static buffers)."""
        self._forward_hooks.append(self.guard(hook))

    def after_update(self, hook: Callable[[], None]) -> None:
        """``hook()`` runs after the engine applied a step's sampled tokens (``update_batch``)."""
        self._after_update_hooks.append(self.guard(hook))

    def run_forward_hooks(self, kwargs: dict[str, Any]) -> None:
        for hook in self._forward_hooks:
            hook(kwargs)

    def run_after_update_hooks(self) -> None:
        for hook in self._after_update_hooks:
            hook()


class Fault(abc.ABC):
    """One fault of the library; ``install`` places its hooks on the engine objects of ``ctx``."""

    spec: ClassVar[FaultSpec]

    @abc.abstractmethod
    def install(self, ctx: FaultContext) -> None: ...

    @property
    def name(self) -> str:
        return self.spec.name


@dataclasses.dataclass(frozen=True)
class Row:
    """One request of a step's batch: its tokens are ``[token_start, token_start + query)`` of the flat
    batch, its read segment in a group starts at the sum of the earlier rows' segment lengths."""

    index: int
    request_id: str
    past: int
    query: int
    token_start: int
    history: Sequence[int]


def batch_rows(host: HostBatch) -> list[Row]:
    rows, t = [], 0
    for i, (rid, past, q, hist) in enumerate(
        zip(host.request_ids, host.past_lens, host.query_lens, host.truth, strict=True)
    ):
        rows.append(Row(i, rid, past, q, t, hist))
        t += q
    return rows


def read_segment_starts(rows: Sequence[Row], window: int) -> list[int]:
    """Start of each row's segment in a group's ``read_index`` (full: past + query entries per row; a
    sliding ring of ``window``: min(past, window - 1) + query)."""
    starts, s = [], 0
    for r in rows:
        starts.append(s)
        s += (min(r.past, window - 1) if window else r.past) + r.query
    return starts
