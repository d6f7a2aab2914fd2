"""The context a transformers fault acts through: the engine objects of one run, and batch-row helpers.

Engine objects (``processor``, ``cache``, ``scheduler``, ``offloading``) are bound when the engine's batch
processor is first seen, before its first step.  ``step`` is the canary step the next (or current) forward
gets; ``host`` is the host batch of the step being prepared or run.
"""

from __future__ import annotations

import abc
import dataclasses
import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from kvcanary.adapters.transformers_cb.geometry import FULL_ATTENTION, SLIDING_ATTENTION
from kvcanary.selftest.protocol import Fault, InjectMode, Injector

if TYPE_CHECKING:
    from kvcanary.adapters.transformers_cb.adapter import TransformersCBAdapter
    from kvcanary.adapters.transformers_cb.host_batch import HostBatch

FULL = FULL_ATTENTION  # the allocator groups, by transformers' layer-type names
SLIDING = SLIDING_ATTENTION


class FaultContext(Injector):
    def __init__(
        self,
        adapter: TransformersCBAdapter,
        mode: InjectMode,
        *,
        rng: random.Random,
        target: tuple[str, int] | None = None,
        page_size: int,
    ) -> None:
        super().__init__(mode, rng=rng, target=target)
        self.adapter = adapter
        self.page_size = page_size
        self.processor: Any = None
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

    # ------------------------------------------------------------------ hooks

    def on_forward(self, hook: Callable[[dict[str, Any], HostBatch], None]) -> None:
        """``hook(kwargs, host)`` runs before each paged forward whose host batch is known (the kwargs are the
        engine's static buffers, ``host`` the scheduler's view of the step)."""

        def with_host(kwargs: dict[str, Any]) -> None:
            host = self.host
            if host is not None:
                hook(kwargs, host)

        self._forward_hooks.append(self.guard(with_host))

    def after_update(self, hook: Callable[[], None]) -> None:
        """``hook()`` runs after the engine applied a step's sampled tokens (``update_batch``)."""
        self._after_update_hooks.append(self.guard(hook))

    def run_forward_hooks(self, kwargs: dict[str, Any]) -> None:
        for hook in self._forward_hooks:
            hook(kwargs)

    def run_after_update_hooks(self) -> None:
        for hook in self._after_update_hooks:
            hook()


TransformersFault = Fault[FaultContext]


class AllocatorFault(TransformersFault):
    """A fault on one allocator group's allocator (``group``): installed only where the model has that group."""

    group: ClassVar[str] = FULL

    def install(self, ctx: FaultContext) -> None:
        alloc = ctx.allocator(self.group)
        if alloc is not None:
            self.install_on(ctx, alloc)

    @abc.abstractmethod
    def install_on(self, ctx: FaultContext, alloc: Any) -> None: ...


class ForwardFault(TransformersFault):
    """A fault on a forward's inputs: :meth:`before_forward` runs before each paged forward (see
    :meth:`FaultContext.on_forward`)."""

    def install(self, ctx: FaultContext) -> None:
        ctx.on_forward(lambda kwargs, host: self.before_forward(ctx, kwargs, host))

    @abc.abstractmethod
    def before_forward(self, ctx: FaultContext, kwargs: dict[str, Any], host: HostBatch) -> None: ...


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


CopyBlocks = Callable[[list[int], list[int]], None]  # an allocator's ``copy_blocks(source_ids, dest_ids)``


def wrap_copy_blocks(ctx: FaultContext, copy: Callable[[Any, CopyBlocks, list[int], list[int]], None]) -> None:
    """This run's fork copies become ``copy(alloc, copy_blocks, source_ids, dest_ids)``: the full group's
    allocator and its own ``copy_blocks`` (nothing is wrapped when the model has no full-attention group)."""
    alloc = ctx.allocator(FULL)
    if alloc is None:
        return

    def make(inner: CopyBlocks) -> CopyBlocks:
        def copy_blocks(source_block_ids: list[int], dest_block_ids: list[int]) -> None:
            copy(alloc, inner, source_block_ids, dest_block_ids)

        return copy_blocks

    ctx.wrap(alloc, "copy_blocks", make)


def wrap_restore(ctx: FaultContext, run: Callable[[Any, Any, Callable[[list[Any]], Any], list[Any]], Any]) -> None:
    """This run's restore becomes ``run(alloc, om, restore, requests_in_batch)``: the full group's allocator, the
    offloading manager and the engine's own restore."""
    alloc = ctx.allocator(FULL)
    if alloc is None:
        return
    om = ctx.offloading

    def make(inner: Any) -> Any:
        def restore_scheduled_requests(requests_in_batch: list[Any]) -> Any:
            return run(alloc, om, inner, requests_in_batch)

        return restore_scheduled_requests

    ctx.wrap(om, "restore_scheduled_requests", make)
