"""Naming the layer whose bytes differ in a slot whose KV digest mismatches (kvcanary.digest_locate)."""

from __future__ import annotations

import pytest
import torch

from kvcanary import digest as D
from kvcanary.digest_locate import MoveSource, MoveSources, component_terms, locate
from kvcanary.ops import digest_reference as dref

SLOTS, HEADS, DIM, LAYERS = 12, 3, 5, 3  # odd sizes: fp16 head rows of 10 bytes are padded to two words


def pool(seed: int = 0) -> tuple[list[torch.Tensor], D.DigestLayout]:
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(SLOTS, HEADS, DIM, generator=gen).to(torch.float16) for _ in range(2 * LAYERS)]
    names = [f"layer{i // 2}.{'kv'[i % 2]}" for i in range(2 * LAYERS)]
    return tensors, D.DigestLayout(tuple(D.token_major(t, n) for t, n in zip(tensors, names, strict=True)))


def stored(layout: D.DigestLayout, slot: int) -> int:
    return int(dref.slot_digests(layout, torch.tensor([slot]))[0])


def test_component_terms_sum_to_the_digest() -> None:
    _, layout = pool()
    for slot in (0, 7, SLOTS - 1):
        assert int(component_terms(layout, slot).sum()) | 1 == stored(layout, slot)


@pytest.mark.parametrize(("comp", "head", "elem", "bit"), [(0, 0, 0, 0), (3, 2, 4, 15), (5, 1, 2, 7)])
def test_a_single_flipped_bit_is_named_exactly(comp: int, head: int, elem: int, bit: int) -> None:
    tensors, layout = pool()
    digest = stored(layout, 4)
    mask = (1 << bit) - (1 << 16 if bit == 15 else 0)  # the bit as a signed 16-bit value
    tensors[comp][4, head, elem : elem + 1].view(torch.int16).bitwise_xor_(mask)
    byte = elem * 2 + bit // 8
    name = layout.components[comp].name
    assert locate(layout, digest, 4) == (
        f"digest: one flipped bit explains the mismatch: {name} head {head} byte {byte} bit {bit % 8}"
    )


def test_unchanged_bytes_and_unknown_changes_say_so() -> None:
    tensors, layout = pool()
    digest = stored(layout, 2)
    assert locate(layout, digest, 2).startswith("digest: the slot's bytes match their digest again")
    assert locate(layout, 0, 2) == ""  # never stamped: nothing to compare
    tensors[1][2] = tensors[1][3]  # a whole row of another slot: more than one bit, and no source known
    assert locate(layout, digest, 2).startswith("digest: layer not found")


def test_a_copy_source_names_every_layer_that_differs() -> None:
    tensors, layout = pool()
    src, dst = torch.tensor([1, 2]), torch.tensor([9, 10])
    digests = dref.slot_digests(layout, src)
    for t in tensors:
        t[dst] = t[src]
    tensors[2][9] += 1.0  # layer1.k of slot 9
    tensors[5][9, 0, 0] = 7.0  # and layer2.v
    sources = MoveSources()
    sources.add(MoveSource(dst, src, layout))
    assert locate(layout, int(digests[0]), 9, sources) == (
        "digest: bytes differ from their copy source (index 1) in layer1.k, layer2.v"
    )
    # A source whose own bytes changed since is not the stamped bytes: it is not used.
    tensors[0][1] += 1.0
    assert locate(layout, int(digests[0]), 9, sources).startswith("digest: layer not found")


def test_a_host_copy_source_in_another_layout() -> None:
    tensors, layout = pool()
    host, host_layout = pool(seed=1)  # a host pool with the same components
    digest = stored(host_layout, 5)
    for t, h in zip(tensors, host, strict=True):
        t[3] = h[5]
    tensors[4][3, 1] = 0.0
    sources = MoveSources()
    sources.add(MoveSource(torch.tensor([3]), torch.tensor([5]), host_layout, "host copy"))
    assert locate(layout, digest, 3, sources) == "digest: bytes differ from their host copy (index 5) in layer2.k"


def test_sources_are_bounded_and_newest_first() -> None:
    _, layout = pool()
    sources = MoveSources(kept=2)
    for i in range(3):
        sources.add(MoveSource(torch.tensor([7]), torch.tensor([i]), layout))
    assert [src for _, src in sources.find(7)] == [2, 1]
    assert sources.find(8) == []
