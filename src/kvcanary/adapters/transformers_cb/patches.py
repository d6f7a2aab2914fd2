"""The transformers adapter's patch table, declared as data.

Each :class:`EnginePatch` names the engine symbol it replaces (module, class, method), what it is for,
and whether the canary is correct without it: a *critical* patch feeds the records or the step tap (the
canary would verify the wrong thing, or nothing), a *counter* patch only feeds :mod:`.features`, a *saving* patch
only makes the canary cheaper.  After a transformers upgrade, :func:`missing` lists the patches whose symbol is gone;
``install`` refuses a missing critical patch by name and skips a missing counter or saving patch with a warning.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
from typing import Any

_CB = "transformers.generation.continuous_batching"


class Role(enum.Enum):
    CRITICAL = "correctness-critical"
    COUNTER = "counter-only"
    SAVING = "host-time saving"  # without it the canary is as correct, at a higher cost


class When(enum.Enum):
    """Which installs apply the patch."""

    ALWAYS = "always"
    FAIL_REQUEST = "mode fail-request"
    RAISE = "mode raise"
    UNPINNED_OFFLOAD = "unpinned_cpu_offload=True"


@dataclasses.dataclass(frozen=True)
class EnginePatch:
    module: str  # the engine module, relative to transformers.generation.continuous_batching
    owner: str  # the class
    method: str
    role: Role
    purpose: str
    when: When = When.ALWAYS

    @property
    def symbol(self) -> str:
        return f"{_CB}.{self.module}.{self.owner}.{self.method}"

    def resolve(self) -> type | None:
        """The class to patch, or None when the engine no longer has the symbol."""
        try:
            module = importlib.import_module(f"{_CB}.{self.module}")
        except ImportError:
            return None
        owner: Any = getattr(module, self.owner, None)
        return owner if isinstance(owner, type) and hasattr(owner, self.method) else None


_C, _N, _S = Role.CRITICAL, Role.COUNTER, Role.SAVING

PATCHES: tuple[EnginePatch, ...] = (
    EnginePatch("input_outputs", "ContinuousBatchingIOs", "prepare_batch_tensors", _C, "the host's view of the step"),
    EnginePatch("model_runner", "ModelRunner", "compute_batch", _C, "the step tap: verify what the forward reads"),
    EnginePatch("cache_allocators.cache_allocator", "CacheAllocator", "copy_blocks", _C, "records follow fork copies"),
    EnginePatch("cache", "PagedAttentionCache", "perform_cache_copy", _S, "a fork's copies mirrored together"),
    EnginePatch("offloading_manager", "OffloadingManager", "_offload_to_cpu", _C, "records follow CPU offloads"),
    EnginePatch("offloading_manager", "OffloadingManager", "restore_scheduled_requests", _C, "records follow restores"),
    EnginePatch("cache_allocators.cache_allocator", "BlockLedger", "register_new_hash", _N, "dedup_swaps"),
    EnginePatch("cache_allocators.cache_allocator", "BlockLedger", "acquire", _N, "cached_block_reuse"),
    EnginePatch("cache", "PagedAttentionCache", "search_prefix_match", _N, "prefix_hits, prefix_tokens"),
    EnginePatch("cache", "PagedAttentionCache", "prepare_fork_request", _N, "forks"),
    EnginePatch(
        "continuous_api", "ContinuousBatchProcessor", "update_batch", _C, "fail reported requests", When.FAIL_REQUEST
    ),
    EnginePatch("continuous_api", "ContinuousMixin", "generate_batch", _C, "re-raise in the caller", When.RAISE),
    EnginePatch(
        "offloading_manager",
        "OffloadingManager",
        "__init__",
        _C,
        "offload without pinned memory",
        When.UNPINNED_OFFLOAD,
    ),
)


def missing(patches: tuple[EnginePatch, ...] = PATCHES) -> list[EnginePatch]:
    """The declared patches whose engine symbol does not exist in the installed transformers."""
    return [p for p in patches if p.resolve() is None]
