"""The KV digest's view of sglang's pools: each layer's K and V (and scales) as components, no copy.

sglang's device pools keep one tensor per layer: ``k_buffer[i]`` / ``v_buffer[i]`` ``[size + page, heads,
dim]`` (MHA, the ``nhd`` layout: token-major, slot = row), or ``[pages, heads, page, dim]`` (``hnd``:
head-major pages, slot = page * page_size + offset); MLA's ``kv_buffer[i]`` ``[size + page, 1, dim]``; the FP4
pools add per-slot scale rows (``k_scale_buffer`` ...), digested with their data.  A hybrid (SWA) pool is
two such pools, one per group, each with its model layer ids (``model_layer_ids``).  The ``vectorized_5d``
layout splits head_dim across two axes and is refused (the digest stays off with a clear error).

HiCache's host pool (``MHATokenToKVPoolHost.kv_buffer`` ``[2, layers, size, heads, dim]`` and its
page-first variants) gets the same components over host indices: the layer-naming reference for bytes
loaded back from the host (:mod:`kvcanary.digest_locate`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvcanary import digest as D
from kvcanary.adapters.sglang.pools import AttachedPool

MHA = ("MHATokenToKVPool", "MHATokenToKVPoolFP4")
MLA = ("MLATokenToKVPool", "MLATokenToKVPoolFP4")


def _layer_ids(pool: Any) -> list[int]:
    ids = getattr(pool, "model_layer_ids", None)
    if ids:
        return [int(i) for i in ids]
    start = int(getattr(pool, "start_layer", 0) or 0)
    return list(range(start, start + int(pool.layer_num)))


def _rows(t: torch.Tensor, layout: str, name: str) -> D.KVComponent:
    if t.dim() == 3:  # [slots, heads, dim] (nhd)
        return D.token_major(t, name)
    if t.dim() == 4 and layout == "hnd":  # [pages, heads, page, dim]
        return D.paged(t, name)
    raise ValueError(f"kvcanary: the KV digest does not support sglang KV layout {layout!r} (tensor {tuple(t.shape)})")


def _scales(buffers: Any, i: int, name: str) -> list[D.KVComponent]:
    if not isinstance(buffers, (list, tuple)) or i >= len(buffers) or buffers[i] is None:
        return []
    return [D.scales(buffers[i], 1, name)]


def single_pool_layout(pool: Any, layers: Sequence[int] | None) -> D.DigestLayout | None:
    """The components of one MHA/MLA pool (None: none of its layers is digested)."""
    kind = type(pool).__name__
    layout = str(getattr(pool, "kv_cache_layout", "nhd") or "nhd")
    comps: list[D.KVComponent] = []
    for i, layer in enumerate(_layer_ids(pool)):
        if layers is not None and layer not in layers:
            continue
        if kind in MHA:
            comps.append(_rows(pool.k_buffer[i], layout, f"layer{layer}.k"))
            comps += _scales(getattr(pool, "k_scale_buffer", None), i, f"layer{layer}.k_scale")
            comps.append(_rows(pool.v_buffer[i], layout, f"layer{layer}.v"))
            comps += _scales(getattr(pool, "v_scale_buffer", None), i, f"layer{layer}.v_scale")
        elif kind in MLA:
            comps.append(_rows(pool.kv_buffer[i], "nhd", f"layer{layer}.kv"))
            comps += _scales(getattr(pool, "kv_scale_buffer", None), i, f"layer{layer}.kv_scale")
        else:
            raise TypeError(f"kvcanary: no KV digest layout for sglang pool class {kind}")
    return D.DigestLayout(tuple(comps)) if comps else None


def pool_layouts(attached: AttachedPool, layers: Sequence[int] | None) -> dict[str, D.DigestLayout]:
    """One layout per canary group of ``attached`` that has digested layers."""
    pool = attached.pool
    subs = [pool] if attached.window_group is None else [pool.full_kv_pool, pool.swa_kv_pool]  # type: ignore[attr-defined]
    out = {}
    for group, sub in zip(attached.groups, subs, strict=True):
        layout = single_pool_layout(sub, layers)
        if layout is not None:
            out[group.name] = layout
    return out


def host_layout(host_pool: Any, device_layout: D.DigestLayout) -> D.DigestLayout | None:
    """HiCache's MHA host pool as components in the device layout's order, over host indices (None: a
    layout or dtype this does not read, or components that do not match the device's)."""
    buf, layout = getattr(host_pool, "kv_buffer", None), getattr(host_pool, "layout", None)
    if not isinstance(buf, torch.Tensor) or type(host_pool).__name__ != "MHATokenToKVPoolHost":
        return None
    per_layer = {
        "layer_first": lambda kv, i: D.token_major(buf[kv, i]),
        "page_first": lambda kv, i: D.token_major(buf[kv, :, i]),
        "page_first_direct": lambda kv, i: D.paged_token_major(buf[kv, :, i]),
        "page_head": lambda kv, i: D.paged(buf[kv, :, :, :, i]),
    }.get(str(layout))
    if per_layer is None:
        return None
    start = int(getattr(host_pool, "start_layer", 0) or 0)
    comps = []
    for comp in device_layout.components:
        layer, _, part = comp.name.removeprefix("layer").partition(".")
        if part not in ("k", "v") or not layer.isdigit():
            return None
        host = per_layer("kv".index(part), int(layer) - start)
        h, c = host.shape, comp.shape
        if (h.heads, h.dim, h.element_size) != (c.heads, c.dim, c.element_size):
            return None
        comps.append(D.KVComponent(host.view, comp.name))
    return D.DigestLayout(tuple(comps))
