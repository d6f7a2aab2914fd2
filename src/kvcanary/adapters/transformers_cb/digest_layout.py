"""The KV digest's view of a transformers ``PagedAttentionCache``: each layer's K and V as components.

Each allocator keeps per-layer views ``_kv_token_views[layer] = (K, V)`` of one flat tensor, shifted so
that the physical index ``block * stride + offset`` is a row of every layer's K and V.  A canary slot
``block * page + offset`` (:mod:`.geometry`) is then row ``block * stride + offset`` of each view: one
``as_strided`` view ``[blocks, page, heads, head_dim]`` per tensor, no copy.  The sentinel slot past the
blocks has no bytes and is never digested.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kvcanary.adapters.transformers_cb.geometry import GroupGeometry
from kvcanary.digest import DigestLayout, KVComponent


def _component(rows: torch.Tensor, geometry: GroupGeometry, name: str) -> KVComponent:
    """``rows`` is a ``[physical rows, heads, head_dim]`` view whose row p is physical index p."""
    rs, hs, ds = rows.stride()
    view = rows.as_strided(
        (geometry.num_blocks, geometry.page_size, int(rows.shape[1]), int(rows.shape[2])),
        (geometry.stride * rs, rs, hs, ds),
        rows.storage_offset(),
    )
    return KVComponent(view, name)


def digest_layouts(
    cache: Any, geometries: Mapping[str, GroupGeometry], layers: tuple[int, ...] | None
) -> dict[str, DigestLayout]:
    """One layout per group that has digested layers (``layers``: those layer indices only; None: all)."""
    out: dict[str, DigestLayout] = {}
    for allocator in cache.cache_allocators.values():
        geometry = geometries.get(str(allocator.layer_type))
        if geometry is None:
            continue
        comps = []
        for layer in allocator.layer_indices:
            if layers is not None and layer not in layers:
                continue
            k, v = allocator._kv_token_views[layer]
            comps += [_component(k, geometry, f"layer{layer}.k"), _component(v, geometry, f"layer{layer}.v")]
        if comps:
            out[geometry.name] = DigestLayout(tuple(comps))
    return out
