"""The canary of one transformers ``PagedAttentionCache`` (groups, capacities, tables, manager) and the
succession of caches one install sees."""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvcanary.adapters.transformers_cb import byte_moves, mirror
from kvcanary.adapters.transformers_cb.digest_layout import digest_layouts, host_layout
from kvcanary.adapters.transformers_cb.geometry import GroupGeometry
from kvcanary.adapters.transformers_cb.queued_moves import MoveCounts, QueuedMoves
from kvcanary.adapters.transformers_cb.translate import StepTranslator
from kvcanary.config import CanaryConfig
from kvcanary.digest import DigestLayout
from kvcanary.layout import RecordRows
from kvcanary.ops import Backend
from kvcanary.runtime import CanaryManager, FailRequestCallback, StepReport
from kvcanary.workspace import Capacities

logger = logging.getLogger("kvcanary")

TABLE_BUDGET_BYTES = 256 << 20  # default cap on the adapter's token tables (all groups + truth)
STAT_KEYS = ("steps", "forwards", "verified_slots", "violations", "skipped_entries", "stamped", "health_failures")


class Binding:
    """The canary of one ``PagedAttentionCache``, which it references weakly: a finished run's cache
    (most of the GPU's memory) must be freed when the engine drops it, not when the canary moves on."""

    def __init__(
        self, cache: Any, geometries: Sequence[GroupGeometry], translator: StepTranslator, manager: CanaryManager
    ) -> None:
        self._cache = weakref.ref(cache)
        self.geometries = {g.name: g for g in geometries}
        self.translator = translator
        self.manager = manager
        self.host = mirror.HostRecords()  # records of the CPU swap pool, by host block
        self.steps = 0  # host steps run on this cache's manager (a report's ``step`` counts the same way)
        self._host_layouts: dict[str, tuple[int, DigestLayout | None]] = {}  # group -> (pool address, layout)
        self._rows: dict[tuple[str, ...], RecordRows | None] = {}  # see rows(): the layout found once
        self.moves: QueuedMoves | None = None  # the block moves queued for the next step's work (see create)

    def is_for(self, cache: Any) -> bool:
        return self._cache() is cache

    def _allocators(self) -> list[Any]:
        cache = self._cache()
        return [] if cache is None else list(cache.cache_allocators.values())

    def owns_allocator(self, allocator: Any) -> bool:
        return any(a is allocator for a in self._allocators())

    def owns_ledger(self, ledger: Any) -> bool:
        return any(a.ledger is ledger for a in self._allocators())

    def records(self, name: str) -> Any:
        return self.manager.canaries[name].records

    def rows(self, names: tuple[str, ...]) -> RecordRows | None:
        """The records of groups ``names`` as rows of one tensor pair (:class:`~kvcanary.layout.RecordRows`), for a
        move that lands in all of them alike; None where they are not laid out so, differ in page size or carry
        digests (the move is then mirrored group by group)."""
        if len(names) < 2:
            return None
        if names not in self._rows:
            one_page = len({self.geometries[n].page_size for n in names}) == 1
            self._rows[names] = RecordRows.of([self.records(n) for n in names]) if one_page else None
        rows = self._rows[names]
        return None if rows is None or any(self.records(n).digests is not None for n in names) else rows

    def host_layout(self, name: str, om: Any) -> DigestLayout | None:
        """Group ``name``'s digest layout over ``om``'s CPU swap pool (built once per pool; None without a
        digest or for a pool it cannot read): where a restore's source bytes are, for naming the layer."""
        digest = self.manager.digest_of(name)
        pool = om._cpu_views.get(name)
        if digest is None or pool is None:
            return None
        key = int(pool.data_ptr())
        kept = self._host_layouts.get(name)
        if kept is None or kept[0] != key:
            block_view = byte_moves.block_view(om.cache.cache_allocators[name])
            kept = (key, host_layout(digest.layout, block_view, pool))
            self._host_layouts[name] = kept
        return kept[1]

    @classmethod
    def create(
        cls,
        runner: Any,
        config: CanaryConfig,
        *,
        backend: Backend,
        max_context: int | None,
        max_positions: object,
        on_fail_request: FailRequestCallback | None,
        move_counts: MoveCounts | None = None,
        queue_moves: bool = True,
    ) -> Binding:
        """Size everything from the cache behind ``runner`` (a transformers ``ModelRunner``).  ``queue_moves``: whether
        the engine's block moves are queued for the step work (:mod:`.queued_moves`) where the layout allows it (CUDA,
        or the CUDA layout under Triton's interpreter); False mirrors each move at once.  ``move_counts``: where the
        queued moves are counted."""
        cache = runner.cache
        geometries = [GroupGeometry.from_allocator(a, cache.num_sectors) for a in cache.cache_allocators.values()]
        max_batch = int(runner.cb_config.max_requests_per_batch)
        max_tokens = int(cache.max_batch_tokens)
        reads = int(cache.max_tokens_read) + max_tokens  # the read-index storage: bounds a step's verify entries
        width = max_context or default_width(reads, max_batch, len(geometries), max_positions)
        caps = Capacities(
            max_batch=max_batch,
            max_tokens=max_tokens,
            verify_entries=max(reads, width),
            max_context=width,
            log_rows=config.log_rows,
        )
        device = torch.device(cache.device)
        translator = StepTranslator(
            geometries, max_batch=max_batch, max_context=width, device=device, max_tokens=max_tokens
        )
        manager = CanaryManager(
            [g.canary_group(i) for i, g in enumerate(geometries)],
            caps,
            config,
            device=device,
            backend=backend,
            on_fail_request=on_fail_request,
            static_batches=translator.static and translator.bucket,  # static buffers, one per shape class
            publish_outbox=True,  # the tap's step graph ends its work by publishing the outbox (no host step copy)
        )
        translator.follow(manager.copy_fence)  # the tap sends and runs the host step on one stream: the engine's
        if config.digest is not None:  # the KV digest reads every layer's K and V of the cache in place
            by_name = {g.name: g for g in geometries}
            manager.attach_digests(digest_layouts(cache, by_name, config.digest.layers))
        binding = cls(cache, geometries, translator, manager)
        if config.digest is None and queue_moves and translator.slotted:
            binding.moves = binding.queued_moves(move_counts)
        return binding

    def queued_moves(self, counts: MoveCounts | None = None) -> QueuedMoves | None:
        """A queue for the block moves (:mod:`.queued_moves`), where every group's records are rows of one tensor
        pair of one page size and the manager publishes; else None (each move mirrored at once)."""
        names = tuple(self.geometries)
        pages = {g.page_size for g in self.geometries.values()}
        rows = RecordRows.of([self.records(n) for n in names])
        fence = self.manager.copy_fence
        if rows is None or len(pages) != 1 or fence is None or fence.seq is None:
            return None
        return QueuedMoves(rows, names, pages.pop(), fence, counts)


def default_width(reads: int, max_batch: int, n_groups: int, max_positions: object) -> int:
    """Longest request verified: the cache's read capacity, capped by the model's positions and a memory budget."""
    width = reads
    if isinstance(max_positions, int) and max_positions > 0:
        width = min(width, max_positions)
    budget = TABLE_BUDGET_BYTES // ((max_batch + 1) * 4 * (n_groups + 1))
    if width > budget:
        logger.warning(
            "kvcanary: verifying requests up to %d tokens (table memory budget); pass max_context to change it",
            budget,
        )
        width = budget
    return max(width, 1)


class Bindings:
    """The binding of the engine cache in use, and the totals of the caches retired before it.

    A new paged cache (a new continuous-batching manager) gets a fresh canary; statistics accumulate.
    """

    def __init__(self, make: Callable[[Any], Binding], collect: Callable[[StepReport | None], None]) -> None:
        self._make = make  # runner -> a new Binding for its cache
        self._collect = collect  # where the last report of a retired binding goes
        self.current: Binding | None = None
        self._retired: dict[str, int] = dict.fromkeys(STAT_KEYS, 0)
        self.setup_ns = 0  # host time spent making bindings (allocations, the canary's set-up): once per cache

    def bind(self, runner: Any) -> tuple[Binding, bool]:
        """The binding for ``runner``'s cache, and whether it was created by this call."""
        if self.current is not None and self.current.is_for(runner.cache):
            return self.current, False
        self.retire()
        start = time.perf_counter_ns()
        self.current = self._make(runner)
        self.setup_ns += time.perf_counter_ns() - start
        return self.current, True

    def retire(self) -> None:
        """Flush the current binding's last step, add its stats to the totals and drop it."""
        b = self.current
        if b is None:
            return
        try:
            self._collect(b.manager.flush())
        finally:
            for k, v in _manager_stats(b.manager).items():
                self._retired[k] = self._retired.get(k, 0) + v
            b.manager.close()
            self.current = None

    def stats(self) -> dict[str, int]:
        out = dict(self._retired)
        out["setup_us"] = self.setup_ns // 1000
        if self.current is not None:
            for k, v in _manager_stats(self.current.manager).items():
                out[k] = out.get(k, 0) + v
        return out


def _manager_stats(manager: CanaryManager) -> dict[str, int]:
    """A manager's counts and its step graphs' (captures and eager steps: where the launch phase's time goes)."""
    return {**manager.stats(), **manager.graph_stats()}
