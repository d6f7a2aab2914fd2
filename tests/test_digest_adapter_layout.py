"""The transformers adapter's digest layout reads exactly the K/V rows the engine writes for a slot.

A stand-in allocator lays out a flat cache the way transformers' full-attention allocator does
(``[K page | V page]`` per layer, layers side by side in a block, per-layer shifted row views); for every
canary slot and layer, the component's row must be the row the engine writes at the slot's physical index.
"""

from __future__ import annotations

import types

import torch

from kvcanary.adapters.transformers_cb.digest_layout import digest_layouts
from kvcanary.adapters.transformers_cb.geometry import GroupGeometry


def _allocator(layers: list[int], page: int, blocks: int, heads: int, dim: int) -> types.SimpleNamespace:
    stride = 2 * page * len(layers)
    flat = torch.randn(blocks * stride, heads, dim).to(torch.bfloat16)
    views = {layer: (flat[(2 * i) * page :], flat[(2 * i + 1) * page :]) for i, layer in enumerate(layers)}
    return types.SimpleNamespace(layer_type="full_attention", layer_indices=layers, _kv_token_views=views)


def test_every_slot_and_layer_maps_to_the_engines_rows() -> None:
    page, blocks, layers = 4, 6, [0, 2, 5]
    alloc = _allocator(layers, page, blocks, 2, 8)
    geometry = GroupGeometry("full_attention", 0, 0, page, 2 * page * len(layers), blocks, 0, 1, 2 * page * 3)
    cache = types.SimpleNamespace(cache_allocators={"full_attention": alloc})
    layout = digest_layouts(cache, {geometry.name: geometry}, None)["full_attention"]
    assert [c.name for c in layout.components] == [f"layer{n}.{kv}" for n in layers for kv in "kv"]
    for slot in range(blocks * page):
        physical = (slot // page) * geometry.stride + slot % page
        if physical != geometry.sentinel_index:  # the sentinel index (in the trash block) has a slot of its own
            assert geometry.to_slots(torch.tensor([physical])).item() == slot
        for comp, (layer, kv) in zip(layout.components, [(n, i) for n in layers for i in (0, 1)], strict=True):
            row = comp.view[slot // page, slot % page]
            assert torch.equal(row, alloc._kv_token_views[layer][kv][physical])
    only = digest_layouts(cache, {geometry.name: geometry}, (2,))["full_attention"]
    assert [c.name for c in only.components] == ["layer2.k", "layer2.v"]
    assert digest_layouts(cache, {geometry.name: geometry}, (7,)) == {}
