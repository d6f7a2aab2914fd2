"""The KV digest's view of a transformers ``PagedAttentionCache``: each layer's K and V as components.

Each allocator keeps per-layer views ``_kv_token_views[layer] = (K, V)`` of one flat tensor, shifted so
that the physical index ``block * stride + offset`` is a row of every layer's K and V.  A canary slot
``block * page + offset`` (:mod:`.geometry`) is then row ``block * stride + offset`` of each view: one
``as_strided`` view ``[blocks, page, heads, head_dim]`` per tensor, no copy.  The sentinel slot past the
blocks has no bytes and is never digested.

The CPU swap pool holds whole blocks byte for byte (row ``h`` of ``[host blocks, bytes_per_block]``), so the
same components over it (:func:`host_layout`) read a host block's slots where the device layout reads a
device block's: what a restore copied from, for naming the layer whose restored bytes differ.
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


def host_layout(device: DigestLayout, block_view: torch.Tensor, host_rows: torch.Tensor) -> DigestLayout | None:
    """``device``'s components over the CPU swap pool: ``host_rows`` is the pool as ``[host blocks,
    bytes_per_block]``, ``block_view`` the device cache as the same rows (:func:`.byte_moves.block_view`).
    Host slot ``h * page + offset`` then holds the bytes a restore copies into device slot ``b * page +
    offset``.  Strided views of the pool, no copy; None when a component does not sit inside its block row."""
    bpb = int(block_view.shape[1])
    if host_rows.dim() != 2 or int(host_rows.shape[1]) != bpb or not host_rows.is_contiguous() or not host_rows.numel():
        return None
    flat = host_rows.reshape(-1)
    comps = []
    for comp in device.components:
        v, shape = comp.view, comp.shape
        size, page, heads, dim = shape.element_size, shape.block_size, shape.heads, shape.dim
        offset = v.data_ptr() - block_view.data_ptr()  # bytes from the start of block 0 (host ints, no sync)
        last = (page - 1) * v.stride(1) + (heads - 1) * v.stride(2) + (dim - 1) * v.stride(3)
        if v.stride(0) * size != bpb or offset < 0 or offset % size or offset + (last + 1) * size > bpb:
            return None
        typed = flat.view(v.dtype)
        view = typed.as_strided((int(host_rows.shape[0]), page, heads, dim), v.stride(),
                                typed.storage_offset() + offset // size)  # fmt: skip
        comps.append(KVComponent(view, comp.name))
    return DigestLayout(tuple(comps))
