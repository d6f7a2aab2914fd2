"""Random KV pools in every layout and dtype the digest reads, and byte-level edits of one slot."""

from __future__ import annotations

import dataclasses
import random

import torch

from kvcanary import digest as D

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
LAYOUTS = ("token_major", "paged", "paged_token_major", "transposed", "vllm_cpu", "sliced", "flat_shifted")


def random_storage(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bytes (NaN and denormal patterns included) viewed as ``dtype``."""
    n = 1
    for s in shape:
        n *= s
    es = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * es,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def layer_components(kind: str, blocks: int, bs: int, heads: int, dim: int, dtype: torch.dtype,
                     gen: torch.Generator) -> list[D.KVComponent]:  # fmt: skip
    """K and V of one layer in layout ``kind`` over ``blocks * bs`` slots."""
    if kind == "token_major":
        return [D.token_major(random_storage((blocks * bs, heads, dim), dtype, gen)) for _ in range(2)]
    if kind == "paged":
        return [D.paged(random_storage((blocks, heads, bs, dim), dtype, gen)) for _ in range(2)]
    if kind == "paged_token_major":
        return [D.paged_token_major(random_storage((blocks, bs, heads, dim), dtype, gen)) for _ in range(2)]
    if kind == "transposed":
        return [D.transposed(random_storage((blocks, heads, dim, bs), dtype, gen)) for _ in range(2)]
    if kind == "vllm_cpu":  # one tensor per layer: per (block, head) K as [dim, bs] then V as [bs, dim]
        s = random_storage((blocks, heads, 2, dim * bs), dtype, gen)
        k = s[:, :, 0].reshape(blocks, heads, dim, bs)
        v = s[:, :, 1].reshape(blocks, heads, bs, dim)
        return [D.transposed(k), D.paged(v)]
    if kind == "sliced":  # rows wider than the head: strided, unaligned head rows
        s = random_storage((blocks * bs, heads, dim + 3), dtype, gen)
        return [D.token_major(s[:, :, :dim]), D.token_major(s[:, :, 3:])]
    if kind == "flat_shifted":  # transformers: [K page | V page] per block, layer views shifted in one tensor
        s = random_storage((blocks * 2 * bs, heads, dim), dtype, gen)
        row = heads * dim
        k = s.as_strided((blocks, bs, heads, dim), (2 * bs * row, row, dim, 1), 0)
        v = s.as_strided((blocks, bs, heads, dim), (2 * bs * row, row, dim, 1), bs * row)
        return [D.paged_token_major(k), D.paged_token_major(v)]
    raise ValueError(kind)


@dataclasses.dataclass
class Pool:
    layout: D.DigestLayout
    num_slots: int


def random_pool(rng: random.Random, *, kind: str | None = None, dtype: torch.dtype | None = None,
                layers: int | None = None, with_scales: bool | None = None) -> Pool:  # fmt: skip
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    kind = kind or rng.choice(LAYOUTS)
    dtype = dtype or rng.choice(DTYPES)
    bs = 1 if kind == "token_major" or kind == "sliced" else rng.choice([1, 2, 3, 4, 16])
    blocks = rng.randint(2, 9)  # at least 2 slots: slot 0 is often reserved
    heads = rng.choice([1, 2, 3, 4])
    dim = rng.choice([1, 2, 3, 5, 7, 8, 13, 16, 24])
    comps: list[D.KVComponent] = []
    for _ in range(layers or rng.randint(1, 3)):
        comps += layer_components(kind, blocks, bs, heads, dim, dtype, gen)
        if with_scales if with_scales is not None else dtype == torch.float8_e4m3fn:
            comps.append(D.scales(random_storage((blocks * bs, heads), torch.float32, gen), bs))
    return Pool(D.DigestLayout(tuple(comps)), blocks * bs)


def element(comp: D.KVComponent, slot: int, head: int, d: int) -> tuple[int, int, int, int]:
    return (*divmod(slot, comp.shape.block_size), head, d)


def flip_bit(comp: D.KVComponent, slot: int, head: int, d: int, bit: int) -> None:
    """Flip bit ``bit`` (little-endian numbering) of one element of ``slot``, bit-exact."""
    idx = element(comp, slot, head, d)
    raw = comp.view[idx].reshape(1).clone().view(torch.uint8)
    raw[bit // 8] ^= 1 << (bit % 8)
    comp.view[idx] = raw.view(comp.view.dtype)[0]


def flip_random_bit(comp: D.KVComponent, slot: int, rng: random.Random) -> None:
    """Flip one random bit of one random element of ``slot`` (draws: head, element, bit)."""
    shape = comp.shape
    flip_bit(comp, slot, rng.randrange(shape.heads), rng.randrange(shape.dim), rng.randrange(8 * shape.element_size))


def copy_slot_bytes(comp: D.KVComponent, dst: int, src: int) -> None:
    bs = comp.shape.block_size
    comp.view[divmod(dst, bs)] = comp.view[divmod(src, bs)]
