"""Counters of the engine features a run exercised, so a clean run can prove it covered them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvcanary.adapters.transformers_cb.binding import Binding


@dataclasses.dataclass
class FeatureCounters:
    prefix_hits: int = 0  # requests scheduled on top of blocks matched by prefix (cross-request sharing)
    prefix_tokens: int = 0  # tokens those matches covered
    cached_block_reuse: int = 0  # blocks taken back from the ledger's cached (unreferenced, hashed) blocks
    dedup_swaps: int = 0  # blocks replaced in place by an identical block after their write (mark_complete_blocks)
    forks: int = 0  # child requests forked from a parent's cache
    fork_block_copies: int = 0  # blocks copied by forks (mirrored into the records)
    offloads: int = 0  # requests whose cache was copied to the CPU swap pool (mirrored)
    soft_resets: int = 0  # requests evicted without a copy (re-prefilled later)
    restores: int = 0  # requests whose cache came back from the CPU swap pool (mirrored)
    ring_wraps: int = 0  # sliding-window writes that overwrote an older token of the ring
    padded_steps: int = 0  # steps the engine padded (compile / CUDA graphs)
    steady_steps: int = 0  # steps that reused a kept translation of their shape class (see steady_step)
    block_table_steps: int = 0  # steps on the decode fast path (flash block table)
    warmup_steps: int = 0  # engine warm-up forwards (fake requests), not verified
    rows_too_long: int = 0  # batch rows longer than the adapter's table, not verified
    caches_bound: int = 0  # paged caches the adapter attached to (one per manager)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class FeatureWatch:
    """Wrapper factories (for :class:`~.patches.PatchSet`) that count the engine features a run used; they
    change nothing (``binding`` returns the adapter's current binding: only its cache is counted)."""

    def __init__(self, binding: Callable[[], Binding | None], features: FeatureCounters) -> None:
        self._binding = binding
        self._features = features

    def register_new_hash(self, original: Callable[..., Any]) -> Callable[..., Any]:
        # A completed block whose hash another block has already: the engine adopts that block in place of it (its
        # mark_complete_blocks, the only caller).  Counted here, once per new hash, rather than by comparing a
        # request's block table before and after each mark_complete_blocks (a copy of the table every call).
        def register_new_hash(ledger: Any, block_id: int, block_hash: int) -> Any:
            identical = original(ledger, block_id, block_hash)
            if identical is not None and (b := self._binding()) is not None and b.owns_ledger(ledger):
                self._features.dedup_swaps += 1
            return identical

        return register_new_hash

    def acquire(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def acquire(ledger: Any, block_id: int) -> Any:
            was_cached = block_id in ledger.cached_blocks
            out = original(ledger, block_id)
            b = self._binding()
            if was_cached and b is not None and b.owns_ledger(ledger):
                self._features.cached_block_reuse += 1
            return out

        return acquire

    def search_prefix_match(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def search_prefix_match(cache: Any, request_id: str, prompt_ids: list[int]) -> int:
            n = int(original(cache, request_id, prompt_ids))
            if n > 0 and (b := self._binding()) is not None and b.is_for(cache):
                self._features.prefix_hits += 1
                self._features.prefix_tokens += n
            return n

        return search_prefix_match

    def prepare_fork_request(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def prepare_fork_request(cache: Any, *args: Any, **kwargs: Any) -> Any:
            forked = original(cache, *args, **kwargs)
            if (b := self._binding()) is not None and b.is_for(cache):
                self._features.forks += len(forked)
            return forked

        return prepare_fork_request
