"""The KV digest's view of vLLM's KV cache: each layer's K and V as strided components, no copy.

**How vLLM 0.32 lays a layer out.**  All layers share one flat byte allocation; each attention layer gets a
4-D strided view with logical axes ``[block, head, token in block, content]`` in the cache's element type
(fp8 caches are stored as ``uint8``).  The content of one (block, head, token) cell is the token's K head
row followed by its V head row.  How the layer, block, head and token axes nest in memory is decided once
per engine (one of six orders, ``VLLM_KV_CACHE_LAYOUT`` or the backends' preference: layers outermost or
blocks outermost, heads inside or outside tokens); the content axis is always innermost.  The view's
strides already encode that order, so a view of the view reads the right bytes whatever it is.  When a
backend needs smaller kernel blocks than the scheduler's, the layer's view has ``r`` times the blocks of
``block_size / r`` tokens; slot numbers (block * block size + offset) are the same in both.

**Backends that read the view alike** (:data:`PAGED_BACKENDS`): ``FLASH_ATTN``, ``FLASHINFER``,
``TRITON_ATTN`` and ``FLEX_ATTENTION`` swap the head and token axes and cut the content at ``head_size``,
so K of slot ``s`` (block ``s // block_size``, offset ``s % block_size``), head ``h`` is
``view[block, h, offset, :head_size]`` and V is ``view[block, h, offset, head_size:]``; their cache write
(the flash ``reshape_and_cache`` op, or its Triton twin) stores the step's K/V rows there.  The components
are ``paged_token_major`` slices of the transposed view.  fp8 caches (``fp8``, ``fp8_e4m3``, ``fp8_e5m2``)
quantise with one K and one V scale per layer (the attention layer's ``k_scale``/``v_scale``), not per
slot: the digest covers the cache bytes only, and a changed scale is outside it.

**Refused** (a ``ValueError`` naming the backend or dtype): packed caches whose content is not K then V
of ``head_size`` each (``nvfp4`` keeps K and V as separate head groups with block scales beside the data;
the ``*_per_token_head`` dtypes pad each half and keep a scale inside it; the diff-KV backends give V
another head size), MLA backends (one latent row per token) and any backend not named here.

**CPU_ATTN** keeps the same logical ``[kernel_blocks, heads, block_size, 2 * head_size]`` tensor (block
contiguous) but reads it as ``[kernel_blocks, heads, 2 * block_size, head_size]``: per (block, head) the
first half is K and the second V.  V is token-major; K is written by ``cpu_attn_reshape_and_cache`` in an
ISA-specific order, transposed ``[head_size, block_size]`` for the vector ISAs.  Which order is *probed*
at install: the op writes a scratch block of known K/V and the bytes are compared with each supported
order, so a slot's component rows are exactly that slot's bytes (or the digest is refused with the reason).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

from kvcanary import digest as D
from kvcanary.adapters.vllm.groups import VllmGroup

K_ORDERS = ("transposed", "token_major")
PAGED_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION")
# Cache dtypes whose cells are plain K then V elements (fp8 ones stored as uint8, scaled per layer).
PLAIN_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
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


def paged_components(kv: torch.Tensor, head_size: int, layer: int) -> list[D.KVComponent]:
    """K and V of one logical ``[blocks, heads, block_size, 2 * head_size]`` layer view (any strides)."""
    if kv.dim() != 4 or int(kv.shape[3]) != 2 * head_size:
        raise ValueError(
            f"kvcanary: layer {layer}'s KV cache {tuple(kv.shape)} is not [blocks, heads, block_size, 2 * {head_size}]"
        )
    tokens = kv.transpose(1, 2)  # [blocks, block_size, heads, K then V]
    return [
        D.paged_token_major(tokens[..., :head_size], f"layer{layer}.k"),
        D.paged_token_major(tokens[..., head_size:], f"layer{layer}.v"),
    ]


def _paged_layer(attn: Any, kv: torch.Tensor, name: str, backend: str) -> list[D.KVComponent]:
    cache_dtype = str(getattr(attn, "kv_cache_dtype", "auto"))
    if cache_dtype not in PLAIN_CACHE_DTYPES:
        raise ValueError(
            f"kvcanary: the KV digest does not read {backend}'s {cache_dtype!r} cache of layer {name} "
            f"(packed K/V or in-cache scales; it reads {', '.join(PLAIN_CACHE_DTYPES)})"
        )
    impl = attn.impl
    heads, head_size = int(impl.num_kv_heads), int(impl.head_size)
    if int(kv.shape[1]) != heads or int(getattr(impl, "head_size_v", None) or head_size) != head_size:
        raise ValueError(
            f"kvcanary: layer {name}'s {backend} cache {tuple(kv.shape)} does not hold K and V of "
            f"{heads} heads x {head_size} side by side"
        )
    return paged_components(kv, head_size, layer_index(name))


def layer_digest_components(attn: Any, kv: torch.Tensor, name: str) -> list[D.KVComponent]:
    """One layer's K and V components, read the way its backend reads them; refuses a layout it does not know."""
    backend = str(attn.attn_backend.get_name()) if hasattr(attn, "attn_backend") else "?"
    if backend in PAGED_BACKENDS:
        return _paged_layer(attn, kv, name, backend)
    if backend == "CPU_ATTN":
        isa = getattr(attn, "isa", None) or getattr(attn.impl, "isa", None)
        order = k_order(str(isa), kv.dtype, int(kv.shape[2]), int(kv.shape[3]) // 2)
        return layer_components(kv, order, layer_index(name))
    raise ValueError(
        f"kvcanary: the KV digest does not know how vLLM's {backend} backend lays out K and V (layer {name}); "
        f"it reads CPU_ATTN, {', '.join(PAGED_BACKENDS)}"
    )


def group_layouts(runner: Any, groups: Sequence[VllmGroup], layers: Sequence[int] | None) -> dict[str, D.DigestLayout]:
    """One layout per group with digested layers; refuses (ValueError) a backend or K order it cannot read."""
    out: dict[str, D.DigestLayout] = {}
    specs = runner.kv_cache_config.kv_cache_groups
    for g in groups:
        comps: list[D.KVComponent] = []
        for name in specs[g.index].layer_names:
            if layers is not None and layer_index(name) not in layers:
                continue
            attn, kv = _kv_cache(runner, name)
            comps += layer_digest_components(attn, kv, name)
        if comps:
            out[g.canary.name] = D.DigestLayout(tuple(comps))
    return out
