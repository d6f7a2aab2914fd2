"""The link hash: pinned vectors, scalar vs tensor agreement, zero-safety, associativity, helpers.

The pins were computed once with the scalar spec and hard-coded, so any change to the definition
(constants, packing, shifts) fails here; the design note repeats some of them.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcanary import hashing
from kvcanary.hashing import (
    LINK_ANCHOR,
    LINK_MULT,
    LINK_MULT_INV,
    MASK64,
    fmix64,
    fmix64_t,
    link_step,
    link_step_t,
    mix,
    mix_t,
    power_table,
    to_signed64,
    to_unsigned64,
)

_SETTINGS = settings(derandomize=True, database=None, deadline=None, max_examples=200)

U64 = st.integers(0, MASK64)
I32 = st.integers(-(2**31), 2**31 - 1)

# --------------------------------------------------------------------------- pinned vectors

FMIX_PINS = [
    (0x0, 0x0),
    (0x1, 0x5692161D100B05E5),
    (0xFFFFFFFFFFFFFFFF, 0xB4D055FCF2CBBD7B),
    (0x0123456789ABCDEF, 0xB2C058E4EBB5112C),
    (0x8000000000000000, 0x25C26EA579CEA98A),
]

MIX_PINS = [
    ((0, 0), 0xB55A8FA067537A72),
    ((1, 0), 0x509252F3A8113DFC),
    ((0, 1), 0x4A5DBE908CCE8312),
    ((42, 7), 0xBB6D98246DE7E54E),
    ((-1, -1), 0xD8D141A3DA3F38F4),
    ((2**31 - 1, 2**31 - 1), 0x9B5467CC353E6D74),
    ((151643, 4095), 0x676316B7CCB9F9DC),
]

# Links of tokens [1, 2, 3] at positions 0, 1, 2 chained from the anchor (also in docs/design.md).
CHAIN_PINS = [0xA2DDD5CF077C3DE9, 0xADD258FCB7121D57, 0x09E95DB7CE4C09A9]


@pytest.mark.parametrize(("x", "want"), FMIX_PINS, ids=[hex(x) for x, _ in FMIX_PINS])
def test_fmix64_pins(x: int, want: int) -> None:
    assert fmix64(x) == want


def test_fmix64_is_splitmix64() -> None:
    # The published SplitMix64 stream for seed 0 (state += golden gamma, then the finaliser).
    gamma = 0x9E3779B97F4A7C15
    stream = [fmix64((gamma * i) & MASK64) for i in (1, 2, 3)]
    assert stream == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


@pytest.mark.parametrize(("args", "want"), MIX_PINS, ids=[str(a) for a, _ in MIX_PINS])
def test_mix_pins(args: tuple[int, int], want: int) -> None:
    assert mix(*args) == want


def test_link_chain_pins() -> None:
    link = LINK_ANCHOR
    got = []
    for pos, tok in enumerate([1, 2, 3]):
        link = link_step(link, tok, pos)
        got.append(link)
    assert got == CHAIN_PINS


def test_link_step_pins() -> None:
    assert link_step(0, 0, 0) == 0xB55A8FA067537A72
    assert link_step(MASK64, 12345, 678) == 0x82AA176638CC8AE9


def test_constants() -> None:
    assert LINK_MULT == 0x9E3779B97F4A7C15
    assert LINK_ANCHOR == 0x6B7663616E617279
    assert LINK_MULT_INV == 0xF1DE83E19937733D
    assert (LINK_MULT * LINK_MULT_INV) & MASK64 == 1
    assert LINK_MULT & 1 and LINK_ANCHOR & 1, "zero-safety needs both odd"
    assert hashing.EMPTY_LINK == 0


def test_mix_uses_only_32_bits_of_each_argument() -> None:
    assert mix(5, 9) == mix(5 + 2**32, 9) == mix(5, 9 - 2**32)
    assert mix(-1, 0) == mix(2**32 - 1, 0)
    assert mix(3, 4) != mix(4, 3)  # positions and tokens are not interchangeable


# --------------------------------------------------------------------------- scalar vs tensor


_EXTREMES_64 = [0, 1, 2, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 2, 2**64 - 1]
_EXTREMES_32 = [0, 1, -1, 2**31 - 1, -(2**31), 7, -7]


def _random_u64(rng: random.Random, n: int) -> list[int]:
    return _EXTREMES_64 + [rng.getrandbits(64) for _ in range(n)]


def test_fmix64_tensor_matches_scalar() -> None:
    xs = _random_u64(random.Random(1), 500)
    got = fmix64_t(torch.tensor([to_signed64(x) for x in xs], dtype=torch.int64)).tolist()
    assert [to_unsigned64(g) for g in got] == [fmix64(x) for x in xs]


def test_mix_and_link_step_tensor_match_scalar() -> None:
    rng = random.Random(2)
    toks = _EXTREMES_32 + [rng.randint(-(2**31), 2**31 - 1) for _ in range(300)]
    poss = [rng.choice([*_EXTREMES_32, rng.randint(0, 1 << 20)]) for _ in toks]
    prevs = [rng.choice([*_EXTREMES_64, rng.getrandbits(64)]) for _ in toks]
    t32 = torch.tensor(toks, dtype=torch.int32)
    p32 = torch.tensor(poss, dtype=torch.int32)
    prev = torch.tensor([to_signed64(x) for x in prevs], dtype=torch.int64)
    assert [to_unsigned64(v) for v in mix_t(t32, p32).tolist()] == [mix(t, p) for t, p in zip(toks, poss, strict=True)]
    want = [link_step(x, t, p) for x, t, p in zip(prevs, toks, poss, strict=True)]
    assert [to_unsigned64(v) for v in link_step_t(prev, t32, p32).tolist()] == want


@_SETTINGS
@given(prev=U64, tok=I32, pos=I32)
def test_link_step_tensor_matches_scalar_property(prev: int, tok: int, pos: int) -> None:
    t32, p32 = torch.tensor([tok], dtype=torch.int32), torch.tensor([pos], dtype=torch.int32)
    got = link_step_t(torch.tensor([to_signed64(prev)]), t32, p32)
    assert to_unsigned64(int(got[0])) == link_step(prev, tok, pos)


# --------------------------------------------------------------------------- zero-safety


@_SETTINGS
@given(tok=I32, pos=I32)
def test_mix_is_even(tok: int, pos: int) -> None:
    assert mix(tok, pos) & 1 == 0


@_SETTINGS
@given(prev_odd=U64, tokens=st.lists(st.tuples(I32, I32), min_size=1, max_size=20))
def test_links_chained_from_an_odd_link_are_odd_and_never_empty(prev_odd: int, tokens: list[tuple[int, int]]) -> None:
    link = prev_odd | 1  # the anchor and every stored link are odd
    for tok, pos in tokens:
        link = link_step(link, tok, pos)
        assert link & 1 == 1
        assert link != hashing.EMPTY_LINK


def test_no_mix_value_cancels_the_anchor_step() -> None:
    # The step from any odd link is odd: MULT*odd is odd and mix is even, whatever mix is.
    for link in (LINK_ANCHOR, 1, MASK64):
        for m in (0, 2, MASK64 - 1, (-LINK_MULT * link) & MASK64 & ~1):
            assert ((LINK_MULT * link + m) & MASK64) & 1 == 1


# --------------------------------------------------------------------------- associativity


def _affine(tok: int, pos: int) -> tuple[int, int]:
    """The step ``x -> a*x + c`` of one record."""
    return LINK_MULT, mix(tok, pos)


def _then(f: tuple[int, int], g: tuple[int, int]) -> tuple[int, int]:
    """``f`` then ``g``: x -> g.a * (f.a * x + f.c) + g.c."""
    return (f[0] * g[0]) & MASK64, (f[1] * g[0] + g[1]) & MASK64


@_SETTINGS
@given(
    seed=U64,
    steps=st.lists(st.tuples(I32, st.integers(0, 2**31 - 1)), min_size=3, max_size=40),
    cut=st.integers(0, 1000),
)
def test_affine_composition_is_associative_and_matches_the_chain(
    seed: int, steps: list[tuple[int, int]], cut: int
) -> None:
    maps = [_affine(t, p) for t, p in steps]
    # Left fold, right fold and a split at a random point all give the same map.
    left = maps[0]
    for m in maps[1:]:
        left = _then(left, m)
    right = maps[-1]
    for m in reversed(maps[:-1]):
        right = _then(m, right)
    k = 1 + cut % (len(maps) - 1)
    a, b = maps[0], maps[k]
    for m in maps[1:k]:
        a = _then(a, m)
    for m in maps[k + 1 :]:
        b = _then(b, m)
    assert left == right == _then(a, b)
    # Applied to a seed, the composed map is the sequential chain.
    link = seed
    for t, p in steps:
        link = link_step(link, t, p)
    assert (left[0] * seed + left[1]) & MASK64 == link


def test_three_maps_associate_exactly() -> None:
    f, g, h = _affine(1, 0), _affine(2, 1), _affine(3, 2)
    assert _then(_then(f, g), h) == _then(f, _then(g, h))


# --------------------------------------------------------------------------- power_table and conversions


@pytest.mark.parametrize("length", [0, 1, 2, 3, 7, 64, 100, 257])
@pytest.mark.parametrize("base", [LINK_MULT, LINK_MULT_INV, 3])
def test_power_table(base: int, length: int) -> None:
    got = power_table(base, length)
    assert got.dtype == torch.int64 and tuple(got.shape) == (length,)
    assert [to_unsigned64(v) for v in got.tolist()] == [pow(base, i, 1 << 64) for i in range(length)]


def test_power_tables_are_inverse() -> None:
    fwd, inv = power_table(LINK_MULT, 50), power_table(LINK_MULT_INV, 50)
    assert torch.equal(fwd * inv, torch.ones(50, dtype=torch.int64))


@_SETTINGS
@given(u=U64)
def test_signed_round_trip(u: int) -> None:
    s = to_signed64(u)
    assert -(2**63) <= s < 2**63
    assert to_unsigned64(s) == u
    assert int(torch.tensor([s], dtype=torch.int64)[0]) == s


@pytest.mark.parametrize(
    ("u", "s"), [(0, 0), (1, 1), (2**63 - 1, 2**63 - 1), (2**63, -(2**63)), (2**64 - 1, -1), (2**64 + 5, 5)]
)
def test_to_signed64_values(u: int, s: int) -> None:
    assert to_signed64(u) == s
    assert to_unsigned64(s) == u & MASK64
