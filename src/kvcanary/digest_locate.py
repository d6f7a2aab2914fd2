"""Which layer's bytes differ when a slot's KV digest mismatches (off the clean path only).

A slot's digest is one 8-byte sum over every component (each layer's K and V): it says *that* the bytes
changed, not where.  When a mismatch is reported, :func:`locate` re-reads the slot (a few slots per
report, never on a clean step) and tries, in order, two ways that are exact where they answer:

1. **A copy source** (bytes moved in by a block copy or a host restore, :class:`MoveSource`): when the
   source's bytes still sum to the stored digest they are the bytes that were stamped, so the components
   whose per-component sums differ between source and slot are exactly the layers that differ (up to a
   per-component collision, about 2^-64).
2. **A single flipped bit** (the common hardware fault): every (word, bit) of the slot is tried; a flip
   that brings the sum back to the stored digest names its component, head, word and bit.  Only a unique
   match is reported (a spurious match has chance about 2^-63 per candidate).

Otherwise the layer is reported as not found.  The clean path pays nothing: sources are kept as the
tensors the move already had (no copy, no sync), in a short bounded queue per group.
"""

from __future__ import annotations

import collections
import dataclasses

import torch

from kvcanary import hashing
from kvcanary.digest import WORD_BYTES, DigestLayout
from kvcanary.ops import digest_reference as dref

KEPT_SOURCES = 8  # moves remembered per group (newest first when locating)
MAX_SEARCH_CANDIDATES = 1 << 24  # (words x 64 bits) beyond which the single-bit search is not tried


@dataclasses.dataclass(frozen=True)
class MoveSource:
    """Slots ``dest`` of the group received the bytes of ``src`` (indices into ``layout``, whose components
    have the same shapes and order as the group's: the group's own layout, or a host pool's)."""

    dest: torch.Tensor
    src: torch.Tensor
    layout: DigestLayout
    what: str = "copy source"


class MoveSources:
    """The last few moves of one group (bounded; tensors kept as given, read only when locating)."""

    def __init__(self, kept: int = KEPT_SOURCES) -> None:
        self._moves: collections.deque[MoveSource] = collections.deque(maxlen=kept)

    def add(self, source: MoveSource) -> None:
        self._moves.append(source)

    def find(self, slot: int) -> list[tuple[MoveSource, int]]:
        """(move, source index) of the moves that wrote ``slot``, newest first."""
        out = []
        for move in reversed(self._moves):
            hit = (move.dest.to("cpu", torch.int64) == slot).nonzero()
            if hit.numel():
                out.append((move, int(move.src.reshape(-1)[int(hit[-1, 0])])))
        return out


def component_terms(layout: DigestLayout, slot: int) -> torch.Tensor:
    """int64 [components]: each component's sum of terms for ``slot`` (the digest is their sum, OR 1)."""
    keys = dref.word_keys(layout.words, layout.device)
    idx = torch.tensor([slot], dtype=torch.int64, device=layout.device)
    out = []
    for comp, base in zip(layout.components, layout.word_bases(), strict=True):
        words = dref._component_words(comp.view, idx)[0]
        out.append(hashing.fmix64_t(words ^ keys[base : base + comp.shape.words]).sum())
    return torch.stack(out).cpu()


def _total(terms: torch.Tensor) -> int:
    return int(terms.sum()) | 1  # int64 sums wrap: the digest's arithmetic mod 2**64


def locate(layout: DigestLayout, stored: int, slot: int, sources: MoveSources | None = None) -> str:
    """A note naming the components (layers) whose bytes differ in ``slot``, or why none is named."""
    if stored == 0:
        return ""
    now = component_terms(layout, slot)
    if _total(now) == stored:
        return "digest: the slot's bytes match their digest again (rewritten or restored since the check)"
    for move, src in sources.find(slot) if sources is not None else []:
        if not 0 <= src < move.layout.num_slots:
            continue
        before = component_terms(move.layout, src)
        if _total(before) != stored or before.shape != now.shape:
            continue  # the source changed since (or differs in shape): it is not the stamped bytes
        names = [_name(layout, c) for c in (before != now).nonzero().flatten().tolist()]
        return f"digest: bytes differ from their {move.what} (index {src}) in {', '.join(names)}"
    flip = single_bit_flip(layout, stored, slot, now)
    if flip is not None:
        return f"digest: one flipped bit explains the mismatch: {flip}"
    return "digest: layer not found (the bytes differ beyond one bit and no intact copy is known)"


def single_bit_flip(layout: DigestLayout, stored: int, slot: int, now: torch.Tensor) -> str | None:
    """The unique (component, head, word, bit) whose flip turns the slot's sum back into ``stored``."""
    if layout.words * 64 > MAX_SEARCH_CANDIDATES:
        return None
    keys = dref.word_keys(layout.words, "cpu")
    idx = torch.tensor([slot], dtype=torch.int64, device=layout.device)
    total = int(now.sum())
    bits = torch.ones(64, dtype=torch.int64) << torch.arange(64, dtype=torch.int64)
    found: list[str] = []
    for c, (comp, base) in enumerate(zip(layout.components, layout.word_bases(), strict=True)):
        words = dref._component_words(comp.view, idx)[0].cpu()
        k = keys[base : base + comp.shape.words]
        old = hashing.fmix64_t(words ^ k)
        new = hashing.fmix64_t((words[:, None] ^ bits[None, :]) ^ k[:, None])
        hit = (((total - old)[:, None] + new) | 1) == stored
        for w, b in hit.nonzero().tolist():
            head, word = divmod(w, comp.shape.words_per_head)
            found.append(f"{_name(layout, c)} head {head} byte {word * WORD_BYTES + b // 8} bit {b % 8}")
    return found[0] if len(found) == 1 else None


def _name(layout: DigestLayout, c: int) -> str:
    return layout.components[c].name or f"component {c}"
