"""The KV digest's view of vLLM's CPU KV cache: each layer's K and V as strided components, no copy.

``CPU_ATTN`` keeps one tensor per layer, ``[kernel_blocks, heads, block_size, 2 * head_size]``, which it
reads as ``[kernel_blocks, heads, 2 * block_size, head_size]``: per (block, head) the first half is K and
the second V.  V is token-major; K is written by ``cpu_attn_reshape_and_cache`` in an ISA-specific order,
transposed ``[head_size, block_size]`` for the vector ISAs.  Which order is *probed* at install: the op
writes a scratch block of known K/V and the bytes are compared with each supported order, so a slot's
component rows are exactly that slot's bytes (or the digest is refused with the reason).  A canary slot
``s`` is kernel block ``s // block_size``, offset ``s % block_size`` of every layer of its group.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

from kvcanary import digest as D
from kvcanary.adapters.vllm.groups import VllmGroup

K_ORDERS = ("transposed", "token_major")
_LAYER = re.compile(r"\.layers\.(\d+)\.")


def layer_index(name: str) -> int:
    m = _LAYER.search(name)
    if m is None:
        raise ValueError(f"kvcanary: cannot read a layer index from vLLM layer name {name!r}")
    return int(m.group(1))


def _kv_cache(runner: Any, name: str) -> tuple[Any, torch.Tensor]:
    attn = runner.compilation_config.static_forward_context[name]
    kv = attn.kv_cache
    if isinstance(kv, (list, tuple)):  # one per virtual engine in some releases
        kv = kv[0]
    if not isinstance(kv, torch.Tensor) or kv.dim() != 4:
        raise ValueError(f"kvcanary: layer {name}'s KV cache is not a 4-D tensor ({type(kv).__name__})")
    return attn, kv


def k_order(isa: str, dtype: torch.dtype, block_size: int, head_size: int) -> str:
    """How ``cpu_attn_reshape_and_cache`` lays out K in a block for ``isa`` (one of :data:`K_ORDERS`)."""
    from vllm import _custom_ops as ops

    gen = torch.Generator().manual_seed(0)
    key, value = (torch.randn(block_size, 1, head_size, generator=gen).to(dtype) for _ in range(2))
    cache = torch.zeros(1, 1, block_size, 2 * head_size, dtype=dtype)
    k_cache, v_cache = cache.view(1, 1, 2 * block_size, head_size).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, torch.arange(block_size), isa)
    region = cache.view(2, block_size * head_size)
    keys = key[:, 0]  # [block_size, head_size]
    if not torch.equal(region[1].view(block_size, head_size), value[:, 0]):
        raise ValueError(f"kvcanary: the KV digest does not know vLLM's CPU V layout for isa {isa!r}")
    if torch.equal(region[0].view(head_size, block_size), keys.t()):
        return "transposed"
    if torch.equal(region[0].view(block_size, head_size), keys):
        return "token_major"
    raise ValueError(f"kvcanary: the KV digest does not know vLLM's CPU K layout for isa {isa!r} (packed K)")


def layer_components(kv: torch.Tensor, order: str, layer: int) -> list[D.KVComponent]:
    """K and V of one ``[blocks, heads, block_size, 2 * head_size]`` CPU cache tensor, as strided views."""
    nb, heads, bs, two_hd = (int(x) for x in kv.shape)
    hd = two_hd // 2
    sb, sh = int(kv.stride(0)), int(kv.stride(1))
    if int(kv.stride(3)) != 1 or int(kv.stride(2)) != two_hd or sh < bs * two_hd:
        raise ValueError(f"kvcanary: unexpected strides {kv.stride()} of a vLLM CPU KV cache tensor")
    off = int(kv.storage_offset())
    if order == "transposed":
        k = D.transposed(kv.as_strided((nb, heads, hd, bs), (sb, sh, bs, 1), off), f"layer{layer}.k")
    else:
        k = D.paged(kv.as_strided((nb, heads, bs, hd), (sb, sh, hd, 1), off), f"layer{layer}.k")
    v = D.paged(kv.as_strided((nb, heads, bs, hd), (sb, sh, hd, 1), off + bs * hd), f"layer{layer}.v")
    return [k, v]


def group_layouts(runner: Any, groups: Sequence[VllmGroup], layers: Sequence[int] | None) -> dict[str, D.DigestLayout]:
    """One layout per group with digested layers; refuses (ValueError) a backend or K order it cannot read."""
    out: dict[str, D.DigestLayout] = {}
    specs = runner.kv_cache_config.kv_cache_groups
    for g in groups:
        comps: list[D.KVComponent] = []
        for name in specs[g.index].layer_names:
            index = layer_index(name)
            if layers is not None and index not in layers:
                continue
            attn, kv = _kv_cache(runner, name)
            backend = str(attn.attn_backend.get_name()) if hasattr(attn, "attn_backend") else "?"
            if backend != "CPU_ATTN":
                raise ValueError(
                    f"kvcanary: the KV digest reads vLLM's CPU_ATTN cache only, layer {name} uses {backend}"
                )
            isa = getattr(attn, "isa", None) or getattr(attn.impl, "isa", None)
            order = k_order(str(isa), kv.dtype, int(kv.shape[2]), int(kv.shape[3]) // 2)
            comps += layer_components(kv, order, index)
        if comps:
            out[g.canary.name] = D.DigestLayout(tuple(comps))
    return out
