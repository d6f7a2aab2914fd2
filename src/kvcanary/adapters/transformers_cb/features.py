"""Counters of the engine features a run exercised, so a clean run can prove it covered them."""

from __future__ import annotations

import dataclasses


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
    block_table_steps: int = 0  # steps on the decode fast path (flash block table)
    warmup_steps: int = 0  # engine warm-up forwards (fake requests), not verified
    rows_too_long: int = 0  # batch rows longer than the adapter's table, not verified
    caches_bound: int = 0  # paged caches the adapter attached to (one per manager)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)
