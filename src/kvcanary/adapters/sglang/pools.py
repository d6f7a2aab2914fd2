"""Which canary groups an sglang KV pool needs, and how to reach its full->window mapping.

sglang's ``req_to_token`` is a token table at every page size (the allocator's ``page_size`` only sets
allocation granularity), so every group here has ``page_size`` 1 in kvcanary's sense.  A pool of
``size`` tokens and page size ``p`` has ``size + p`` slots: the first page is the padding page (slot 0
takes padded writes; the allocators never hand out page 0), so its slots are declared reserved.

Pools are matched by exact class name, never by subclass: a subclass may change the layout (sglang's
``DSATokenToKVPool`` subclasses the MLA pool and adds an indexer cache).  Nothing here imports sglang.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvcanary.layout import CanaryGroup, GroupKind

# Pools whose token slots are the KV slots one-to-one (what the canary shadows).
SINGLE_POOLS = ("MHATokenToKVPool", "MHATokenToKVPoolFP4", "MLATokenToKVPool", "MLATokenToKVPoolFP4")
SWA_POOLS = ("SWAKVPool",)
SUPPORTED_POOLS = SINGLE_POOLS + SWA_POOLS

_ATTACHED = "_kvcanary_attached"  # marker attribute set on an attached pool
_MAX_RESERVED = CanaryGroup.MAX_RESERVED


@dataclasses.dataclass(frozen=True)
class AttachedPool:
    """The groups of one attached pool; ``lookup`` is the SWA group's full->window mapping source."""

    pool: object
    groups: tuple[CanaryGroup, ...]
    window_group: str | None  # name of the group reached through the mapping, if any

    def lookup(self) -> torch.Tensor:
        """The pool's live ``full_to_swa_index_mapping`` (registered by its allocator, updated in place)."""
        mapping = getattr(self.pool, "full_to_swa_index_mapping", None)
        if not isinstance(mapping, torch.Tensor):
            raise ValueError(
                f"{type(self.pool).__name__} has no full_to_swa_index_mapping registered; create its "
                "SWATokenToKVPoolAllocator (which registers the mapping) before the first forward"
            )
        full = self.groups[0].num_slots
        if mapping.dim() != 1 or mapping.shape[0] < full:
            raise ValueError(
                f"full_to_swa_index_mapping has shape {tuple(mapping.shape)}, expected 1-D with at least "
                f"{full} entries (one per full-pool slot)"
            )
        return mapping

    def detach(self) -> None:
        if getattr(self.pool, _ATTACHED, False):
            delattr(self.pool, _ATTACHED)


def _int_attr(obj: object, name: str, what: str) -> int:
    value = getattr(obj, name, None)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what}.{name} must be an int, got {value!r}")
    if value <= 0:
        raise ValueError(f"{what}.{name} must be positive, got {value}")
    return value


def pool_slots(pool: object) -> int:
    """Slot count of a single (MHA/MLA) pool: ``size + page_size`` (padding page included)."""
    what = type(pool).__name__
    slots = _int_attr(pool, "size", what) + _int_attr(pool, "page_size", what)
    for attr in ("k_buffer", "kv_buffer"):  # cross-check against the real buffer where there is one
        bufs = getattr(pool, attr, None)
        if isinstance(bufs, (list, tuple)) and bufs and isinstance(bufs[0], torch.Tensor):
            rows = int(bufs[0].shape[0])
            if rows != slots:
                raise ValueError(f"{what}.{attr}[0] has {rows} rows, expected size + page_size = {slots}")
    return slots


def _reserved(page_size: int, num_slots: int) -> tuple[int, ...]:
    # The whole padding page when it fits the group's reserved list, else its first slots.
    return tuple(range(min(page_size, _MAX_RESERVED, num_slots)))


def attach_pool(pool: object, *, sliding_window: int | None, draft: bool, owner: str) -> AttachedPool:
    """Describe ``pool``'s groups and mark it attached; refuses an unknown class or a second attach."""
    name = type(pool).__name__
    if name not in SUPPORTED_POOLS:
        raise TypeError(
            f"kvcanary's sglang adapter does not support KV pool class {name}; supported: {', '.join(SUPPORTED_POOLS)}"
        )
    if getattr(pool, _ATTACHED, False):
        raise ValueError(f"a kvcanary canary is already attached to this {name} ({getattr(pool, _ATTACHED)})")
    offset = 1 if draft else 0
    prefix = "draft-" if draft else ""
    base_id = 2 if draft else 0
    window_group = None
    if name in SINGLE_POOLS:
        slots = pool_slots(pool)
        page = _int_attr(pool, "page_size", name)
        groups: tuple[CanaryGroup, ...] = (_group(f"{prefix}full", base_id, slots, page, offset),)
    else:
        full_slots, swa_slots, window = _hybrid_slots(pool, name, sliding_window)
        page = _int_attr(pool, "page_size", name)
        window_group = f"{prefix}swa"
        groups = (
            _group(f"{prefix}full", base_id, full_slots, page, offset),
            _group(window_group, base_id + 1, swa_slots, page, offset, window=window),
        )
    attached = AttachedPool(pool=pool, groups=groups, window_group=window_group)
    if window_group is not None and getattr(pool, "full_to_swa_index_mapping", None) is not None:
        attached.lookup()  # validate its shape now when it is already there
    setattr(pool, _ATTACHED, owner)
    return attached


def _hybrid_slots(pool: object, name: str, sliding_window: int | None) -> tuple[int, int, int]:
    """A hybrid (full + sliding-window) pool's slot counts and window size, each checked."""
    full_pool = getattr(pool, "full_kv_pool", None)
    swa_pool = getattr(pool, "swa_kv_pool", None)
    for role, sub in (("full_kv_pool", full_pool), ("swa_kv_pool", swa_pool)):
        if type(sub).__name__ not in SINGLE_POOLS:
            raise TypeError(f"{name}.{role} is a {type(sub).__name__}; supported sub-pools: {', '.join(SINGLE_POOLS)}")
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window <= 0:
        raise ValueError(
            f"{name} needs the model's sliding window size (model_runner.sliding_window_size), got {sliding_window!r}"
        )
    return pool_slots(full_pool), pool_slots(swa_pool), sliding_window


def _group(name: str, group_id: int, slots: int, page: int, token_offset: int, window: int = 0) -> CanaryGroup:
    """One pool's canary group; with a ``window``, the sliding-window group (read through the full-to-swa lookup)."""
    sliding: dict[str, Any] = {}
    if window:
        sliding = {"kind": GroupKind.SLIDING_WINDOW, "window": window, "uses_lookup": True}
    return CanaryGroup(
        num_slots=slots, group_id=group_id, name=name, token_offset=token_offset,
        reserved_slots=_reserved(page, slots), **sliding,
    )  # fmt: skip
