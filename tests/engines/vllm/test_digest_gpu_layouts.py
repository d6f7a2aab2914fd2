"""The KV digest reads vLLM's GPU attention caches (FLASH_ATTN, FLASHINFER, TRITON_ATTN, FLEX_ATTENTION).

No GPU here, so each cache is allocated on the CPU by vLLM's own allocation code (the KV cache config of a
group of two layers, the kernel block size the backend class accepts, ``allocate_kv_cache`` in each of the six
layouts the backend allows), K/V of random slots are written the way the flash cache write places them
(emulated with torch indexing: the CUDA op is not built here), and the components the adapter builds must
hold exactly each slot's bytes, every head, and give a digest that changes with one byte of that slot in any
layer (K or V) and with nothing else.  vLLM's own block copy must carry the digest along.  FLASHINFER's class
imports the GPU-only ``flashinfer`` package, so where that is missing its stated facts stand in (below).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import types
from typing import Any

import pytest
import torch

from kvcanary import digest as D
from kvcanary.adapters.vllm.digest_layout import PAGED_BACKENDS, group_layouts, layer_digest_components
from kvcanary.adapters.vllm.groups import VllmGroup
from kvcanary.layout import CanaryGroup
from kvcanary.ops import digest_reference as dref

NUM_BLOCKS = 5  # scheduler blocks
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@dataclasses.dataclass(frozen=True)
class Case:
    cache_dtype: str
    heads: int
    head_size: int
    block_size: int  # the scheduler's; the kernel block is what the backend class accepts


CASES = (
    Case("bfloat16", 1, 64, 16),
    Case("float16", 3, 80, 48),
    Case("fp8", 3, 128, 128),  # FLASHINFER: kernel blocks of 64, two per scheduler block
    Case("bfloat16", 3, 128, 32),
    Case("fp8_e5m2", 1, 64, 64),
)


class FlashInferFacts:
    """What FLASHINFER's backend class states (its module needs ``flashinfer``): fixed kernel block sizes,
    head sizes, cache dtypes (``nvfp4`` left out: packed, refused by the digest), any layout off SM100."""

    supported_kv_cache_dtypes = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")

    @staticmethod
    def get_name() -> str:
        return "FLASHINFER"

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int]:
        return [16, 32, 64]

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size in (64, 128, 256, 512)

    @classmethod
    def supported_kv_cache_layouts(cls) -> None:
        return None


def backend_class(name: str) -> Any:
    if name == "FLASHINFER" and importlib.util.find_spec("flashinfer") is None:
        return FlashInferFacts
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum[name].get_class()


def _layouts(name: str) -> list[Any]:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    return list(backend_class(name).supported_kv_cache_layouts() or KVCacheLayout)


def _cases(name: str) -> list[Case]:
    cls = backend_class(name)
    return [c for c in CASES if c.cache_dtype in cls.supported_kv_cache_dtypes and cls.supports_head_size(c.head_size)]


@dataclasses.dataclass
class Allocated:
    caches: dict[str, torch.Tensor]  # the layer views vLLM binds to its attention layers
    raw: torch.Tensor  # the one backing allocation
    kernel_block: int
    runner: Any
    group: VllmGroup


def allocate(name: str, case: Case, layout: Any) -> Allocated | None:
    """The cache as vLLM's runner allocates it; None where vLLM itself refuses that layout for these blocks."""
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
    from vllm.v1.worker.utils import allocate_kv_cache, select_common_block_size

    cls = backend_class(name)
    dtype = STR_DTYPE_TO_TORCH_DTYPE.get(case.cache_dtype, torch.bfloat16)
    spec = FullAttentionSpec(block_size=case.block_size, num_kv_heads=case.heads, head_size=case.head_size, dtype=dtype)
    group_spec = KVCacheGroupSpec(list(LAYERS), spec)
    cache_config = types.SimpleNamespace(
        get_resolved_kv_cache_layout=lambda: layout, num_gpu_blocks_override=NUM_BLOCKS,
        prefix_cache_retention_interval=None,
    )  # fmt: skip
    attention_config = types.SimpleNamespace(hisparse_config=None)
    vllm_config = types.SimpleNamespace(cache_config=cache_config, attention_config=attention_config)
    config = get_kv_cache_config_from_groups(vllm_config, [group_spec], 1 << 30)
    kernel_block = select_common_block_size(case.block_size, [cls], [spec])
    try:
        caches = allocate_kv_cache(config, torch.device("cpu"), layout, [kernel_block])
    except ValueError as e:  # blocks interleaved across layers cannot be cut into kernel blocks
        assert kernel_block < case.block_size and "kernel blocks" in str(e)
        return None
    attn = {
        layer: types.SimpleNamespace(
            kv_cache=caches[layer], kv_cache_dtype=case.cache_dtype, attn_backend=cls,
            impl=types.SimpleNamespace(num_kv_heads=case.heads, head_size=case.head_size),
        )
        for layer in LAYERS
    }  # fmt: skip
    runner = types.SimpleNamespace(
        compilation_config=types.SimpleNamespace(static_forward_context=attn), kv_cache_config=config
    )
    canary = CanaryGroup(num_slots=NUM_BLOCKS * case.block_size, page_size=kernel_block, padding_row=None)
    group = VllmGroup(canary, 0, LAYERS[0], case.block_size, True)
    raw = caches[LAYERS[0]]
    return Allocated(caches, raw, kernel_block, runner, group)


def write_like_the_flash_cache_write(
    kv: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache_dtype: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token i's head h goes to ``kv[b, h, o, :head_size]`` (K) and ``kv[b, h, o, head_size:]`` (V) of the
    logical layer view, ``b, o = divmod(slots[i], block_size)``; an fp8 cache stores ``x / scale`` (scale 1
    here: per layer, not per slot) as e4m3/e5m2 bytes.  Returns the stored K and V."""
    head_size = key.shape[-1]
    if cache_dtype in FP8:
        key, value = (x.to(FP8[cache_dtype]).view(torch.uint8) for x in (key, value))
    else:
        key, value = key.to(kv.dtype), value.to(kv.dtype)
    b, o = slots // kv.shape[2], slots % kv.shape[2]
    kv[b, :, o, :head_size] = key
    kv[b, :, o, head_size:] = value
    return key, value


def _fill(al: Allocated, case: Case, gen: torch.Generator) -> tuple[torch.Tensor, dict[str, tuple[Any, Any]]]:
    """Random bytes everywhere, then K/V of random slots written per layer; returns (slots, stored K/V per layer)."""
    storage = al.raw.untyped_storage()
    noise = torch.randint(-128, 128, (storage.nbytes(),), dtype=torch.int8, generator=gen)
    storage.copy_(noise.untyped_storage())
    num_slots = NUM_BLOCKS * case.block_size
    slots = torch.randperm(num_slots, generator=gen)[: max(3, num_slots // 4)]
    written = {}
    for layer in LAYERS:
        k, v = (torch.randn(len(slots), case.heads, case.head_size, generator=gen) for _ in range(2))
        written[layer] = write_like_the_flash_cache_write(al.caches[layer], slots, k, v, case.cache_dtype)
    return slots, written


def _flip(kv: torch.Tensor, slot: int, head: int, element: int, byte: int) -> None:
    """Flips one bit of one byte of a slot's cell, addressed through the logical layer view."""
    cells = kv.view(torch.uint8)  # the content axis is innermost in every layout
    b, o = divmod(slot, kv.shape[2])
    cells[b, head, o, element * kv.element_size() + byte] ^= 0x10


@pytest.mark.parametrize("name", PAGED_BACKENDS)
def test_components_hold_each_slots_bytes_and_the_digest_sees_one_byte(name: str) -> None:
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    ran = 0
    for case in _cases(name):
        for layout in _layouts(name):
            al = allocate(name, case, layout)
            if al is None:
                continue
            ran += 1
            slots, written = _fill(al, case, gen)
            layout_ = group_layouts(al.runner, [al.group], None)["full"]
            comps = layout_.components
            assert [c.name for c in comps] == ["layer0.k", "layer0.v", "layer1.k", "layer1.v"]
            assert all(c.shape.block_size == al.kernel_block and c.shape.heads == case.heads for c in comps)
            storage = al.raw.untyped_storage().data_ptr()
            assert all(c.view.untyped_storage().data_ptr() == storage for c in comps)  # views, never copies
            for li, layer in enumerate(LAYERS):
                k, v = written[layer]
                for i, slot in enumerate(slots.tolist()):
                    b, o = divmod(slot, al.kernel_block)
                    assert torch.equal(comps[2 * li].view[b, o], k[i]), (case, layout, layer, slot)
                    assert torch.equal(comps[2 * li + 1].view[b, o], v[i]), (case, layout, layer, slot)
            _check_one_byte(al, case, layout_, slots, gen)
    assert ran >= len(_cases(name)) > 0


def _check_one_byte(
    al: Allocated, case: Case, layout: D.DigestLayout, slots: torch.Tensor, gen: torch.Generator
) -> None:
    every = torch.arange(layout.num_slots)
    clean = dref.slot_digests(layout, every)
    target = int(slots[int(torch.randint(len(slots), (1,), generator=gen))])
    for layer in LAYERS:
        for element in (0, case.head_size, 2 * case.head_size - 1):  # K's first, V's first and last
            head = int(torch.randint(case.heads, (1,), generator=gen))
            byte = int(torch.randint(al.caches[layer].element_size(), (1,), generator=gen))
            _flip(al.caches[layer], target, head, element, byte)
            changed = (dref.slot_digests(layout, every) != clean).nonzero().flatten().tolist()
            assert changed == [target], (case, layout, layer, element)
            _flip(al.caches[layer], target, head, element, byte)
    assert torch.equal(dref.slot_digests(layout, every), clean)


@pytest.mark.parametrize("name", PAGED_BACKENDS)
def test_vllms_block_copy_carries_the_digest(name: str) -> None:
    from vllm.v1.worker.utils import copy_kv_cache_blocks_inplace

    gen = torch.Generator().manual_seed(7)
    for case in _cases(name)[:2]:
        for layout in _layouts(name):
            al = allocate(name, case, layout)
            if al is None:
                continue
            _fill(al, case, gen)
            dl = group_layouts(al.runner, [al.group], None)["full"]
            every = torch.arange(dl.num_slots)
            before = dref.slot_digests(dl, every).view(NUM_BLOCKS, case.block_size)
            pairs = [(1, 3), (4, 1)]  # block 1 is a source and a destination: sources are read first
            copy_kv_cache_blocks_inplace([al.caches[n] for n in LAYERS], NUM_BLOCKS, pairs)
            after = dref.slot_digests(dl, every).view(NUM_BLOCKS, case.block_size)
            expected = before.clone()
            for src, dst in pairs:
                expected[dst] = before[src]
            assert torch.equal(after, expected), (case, layout)


def _attn(backend: str, cache_dtype: str, heads: int, head_size: int) -> Any:
    backend_cls = types.SimpleNamespace(get_name=lambda: backend)
    impl = types.SimpleNamespace(num_kv_heads=heads, head_size=head_size)
    return types.SimpleNamespace(attn_backend=backend_cls, kv_cache_dtype=cache_dtype, impl=impl)


@pytest.mark.parametrize(
    ("backend", "cache_dtype", "heads", "match"),
    [
        ("FLASHINFER", "nvfp4", 2, "'nvfp4' cache"),
        ("TRITON_ATTN", "int8_per_token_head", 2, "'int8_per_token_head' cache"),
        ("FLASH_ATTN_DIFFKV", "auto", 2, "does not know how vLLM's FLASH_ATTN_DIFFKV backend"),
        ("FLASHMLA", "auto", 2, "does not know how vLLM's FLASHMLA backend"),
        ("FLASH_ATTN", "auto", 4, "does not hold K and V of 4 heads"),
    ],
)
def test_layouts_it_cannot_read_are_refused_by_name(backend: str, cache_dtype: str, heads: int, match: str) -> None:
    kv = torch.zeros(3, 2, 16, 2 * 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        layer_digest_components(_attn(backend, cache_dtype, heads, 64), kv, LAYERS[1])


def test_a_head_size_that_does_not_split_the_cell_is_refused() -> None:
    kv = torch.zeros(3, 2, 16, 2 * 64 + 16, dtype=torch.bfloat16)  # padded cells: not K then V of 64
    with pytest.raises(ValueError, match="not \\[blocks, heads, block_size, 2 \\* 64\\]"):
        layer_digest_components(_attn("TRITON_ATTN", "auto", 2, 64), kv, LAYERS[0])


def test_layer_selection_and_block_size_one_is_not_a_gpu_kernel_block() -> None:
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import select_common_block_size

    al = allocate("FLASH_ATTN", CASES[1], KVCacheLayout.LBNHC)
    assert al is not None
    only = group_layouts(al.runner, [al.group], (1,))
    assert [c.name for c in only["full"].components] == ["layer1.k", "layer1.v"]
    assert group_layouts(al.runner, [al.group], (7,)) == {}
    for name in PAGED_BACKENDS:  # no GPU backend takes one-token blocks, so none is tested
        with pytest.raises(ValueError, match="No common block size"):
            select_common_block_size(1, [backend_class(name)])
