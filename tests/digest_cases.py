"""Random KV pools in every layout and dtype the digest reads, byte-level edits of one slot, planned steps."""

from __future__ import annotations

import dataclasses
import random

import torch

from kvcanary import CanaryGroup, Capacities, GroupKind, StepBatch
from kvcanary import digest as D
from kvcanary.layout import RecordStore
from kvcanary.ops import reference as ref
from kvcanary.workspace import GroupState, PlanWorkspace, ViolationLog

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


def planned_step(
    num_slots: int, prefix: list[int], *, window: int = 0, page: int = 1, seed: int = 5,
    device: torch.device | str = "cpu",
) -> tuple[CanaryGroup, StepBatch, PlanWorkspace]:  # fmt: skip
    """A group and a decode step whose rows (after padding row 0) have the given prefixes.

    Table entries are a random permutation of the pool's pages past page 0 (slots when ``page`` is 1);
    a prefix of 0 is a row that reads nothing.
    """
    kind = GroupKind.SLIDING_WINDOW if window else GroupKind.FULL
    group = CanaryGroup(num_slots=num_slots, kind=kind, window=window, page_size=page, reserved_slots=(0,))
    pages = [-(-(n + 1) // page) for n in prefix]
    perm = torch.randperm(num_slots // page - 1, generator=torch.Generator().manual_seed(seed)) + 1
    table = torch.zeros(len(prefix) + 1, max(pages), dtype=torch.int64)
    used = 0
    for r, n in enumerate(pages, start=1):
        table[r, :n] = perm[used : used + n]
        used += n
    b = len(prefix)
    rows, pre = torch.arange(1, b + 1), torch.tensor(prefix)
    loc = table[rows, pre // page] * page + pre % page
    parts = {
        "rows": rows, "prefix_lens": pre, "extend_lens": torch.ones(b, dtype=torch.int64), "table": table,
        "input_ids": torch.zeros(b, dtype=torch.int64), "positions": pre.clone(), "out_cache_loc": loc,
    }  # fmt: skip
    batch = StepBatch(**{k: v.to(device) for k, v in parts.items()})
    caps = Capacities(max_batch=max(b, 1), max_tokens=max(b, 1), verify_entries=sum(prefix) + 1)
    ws = PlanWorkspace.allocate(caps, device, num_slots=num_slots)
    ref.plan(GroupState(group, RecordStore.allocate(num_slots, device), ws, ViolationLog.allocate(8, device)), batch)
    return group, batch, ws
