"""The KV digest: an exact 8-byte summary of the real K/V bytes of one slot (``docs/design.md`` §12).

A slot's bytes are read through its group's **components**: one strided view per tensor the engine keeps
for that slot (each layer's K and V, and the scales of a quantised pool), in a fixed order.  Each
component row is ``heads`` head rows of ``dim`` elements; a head row's bytes (little-endian elements in
``dim`` order) are zero-padded to whole 64-bit words.  Word ``j`` of head ``h`` of component ``c`` gets the
slot-independent index ``i = word_base[c] + h * words_per_head[c] + j`` and contributes

    term(w, i) = fmix64(w XOR key(i)),   key(i) = fmix64(DIGEST_SEED + (i + 1) * DIGEST_GAMMA)

(``key(i)`` is the i-th SplitMix64 output); the digest is ``(sum of terms mod 2**64) | 1``.  It is
content-only (no slot id), order-independent (partial sums over layers, heads or shards add up), and
index-bound (a word moved to another index changes its term).  Digests are odd; 0 means "no digest".

This module holds the definition's host objects (components, layout, workspace); the vectorised
reference is :mod:`kvcanary.ops.digest_reference`, the kernel :mod:`kvcanary.ops.kernels.digest`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

DIGEST_SEED = 0x4B5644696765737F  # "KVDigest" with the top bit of the last byte cleared
DIGEST_GAMMA = 0x9E3779B97F4A7C15  # the SplitMix64 increment: key(i) is its i-th output
NO_DIGEST = 0  # a slot never digested; every digest is odd
WORD_BYTES = 8
ELEMENT_SIZES = (1, 2, 4, 8)
TILE_TOKENS = 16  # budgeted verify selects positions in runs of this many (a kernel tile's entries)


class ComponentShape(NamedTuple):
    """A component's geometry: ``blocks`` blocks of ``block_size`` slots; a slot holds ``heads`` head rows of
    ``dim`` elements of ``element_size`` bytes each."""

    blocks: int
    block_size: int
    heads: int
    dim: int
    element_size: int

    @property
    def num_slots(self) -> int:
        return self.blocks * self.block_size

    @property
    def words_per_head(self) -> int:
        """64-bit words of one head row (its bytes zero-padded to a whole word)."""
        return -(-self.dim * self.element_size // WORD_BYTES)

    @property
    def words(self) -> int:
        return self.heads * self.words_per_head


@dataclasses.dataclass(frozen=True)
class KVComponent:
    """One tensor's bytes of each slot, as a 4-D strided view ``[num_blocks, block_size, heads, dim]``.

    Slot ``s`` is ``view[s // block_size, s % block_size]``.  The view may have any strides (a permuted or
    ``as_strided`` view of the engine's tensor, never a copy); its element size must be 1, 2, 4 or 8 bytes.
    ``shape`` is its geometry, read once when the component is built.  Build it with the layout helpers below.
    """

    view: torch.Tensor
    name: str = ""
    shape: ComponentShape = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        v = self.view
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"component {self.name!r}: view must be a torch.Tensor, got {type(v).__name__}")
        if v.dim() != 4:
            raise ValueError(
                f"component {self.name!r}: view must be 4-D [blocks, block_size, heads, dim], got {v.shape}"
            )
        if v.element_size() not in ELEMENT_SIZES:
            raise ValueError(f"component {self.name!r}: element size {v.element_size()} not in {ELEMENT_SIZES}")
        if v.is_complex() or min(v.shape) <= 0:
            raise ValueError(f"component {self.name!r}: needs a real dtype and non-empty dims, got {v.dtype} {v.shape}")
        if any(s < 0 for s in v.stride()):
            raise ValueError(f"component {self.name!r}: negative strides are not supported")
        blocks, block_size, heads, dim = v.shape
        object.__setattr__(self, "shape", ComponentShape(blocks, block_size, heads, dim, v.element_size()))  # frozen


def token_major(t: torch.Tensor, name: str = "") -> KVComponent:
    """``[slots, heads, dim]`` (sglang's pools, vLLM's flash layout flattened): block size 1."""
    return KVComponent(t.unsqueeze(1), name)


def paged(t: torch.Tensor, name: str = "") -> KVComponent:
    """``[blocks, heads, block_size, dim]`` (head-major pages)."""
    return KVComponent(t.permute(0, 2, 1, 3), name)


def paged_token_major(t: torch.Tensor, name: str = "") -> KVComponent:
    """``[blocks, block_size, heads, dim]`` (vLLM flash attention, transformers' page views)."""
    return KVComponent(t, name)


def transposed(t: torch.Tensor, name: str = "") -> KVComponent:
    """``[blocks, heads, dim, block_size]``: K stored transposed per block (vLLM's CPU cache)."""
    return KVComponent(t.permute(0, 3, 1, 2), name)


def scales(t: torch.Tensor, block_size: int = 1, name: str = "") -> KVComponent:
    """Per-(slot, head) scales ``[slots, heads]`` of a quantised pool: each head row is one element."""
    return KVComponent(t.reshape(-1, block_size, t.shape[-1], 1), name)


@dataclasses.dataclass(frozen=True)
class DigestLayout:
    """The ordered components of one group; every component must cover the group's slots."""

    components: tuple[KVComponent, ...]

    def __post_init__(self) -> None:
        if not self.components:
            raise ValueError("a digest layout needs at least one component")
        devices = {c.view.device for c in self.components}
        if len(devices) != 1:
            raise ValueError(f"digest components live on several devices: {sorted(map(str, devices))}")

    @property
    def device(self) -> torch.device:
        return self.components[0].view.device

    @property
    def num_slots(self) -> int:
        """Slots every component covers."""
        return min(c.shape.num_slots for c in self.components)

    def word_bases(self) -> list[int]:
        bases, total = [], 0
        for c in self.components:
            bases.append(total)
            total += c.shape.words
        return bases

    @property
    def words(self) -> int:
        return sum(c.shape.words for c in self.components)

    @property
    def bytes_per_slot(self) -> int:
        return sum(c.shape.heads * c.shape.dim * c.shape.element_size for c in self.components)


@dataclasses.dataclass
class DigestWorkspace:
    """Static per-group buffers of the digest calls, sized once from a capacity in entries.

    ``acc[e]`` sums entry e's terms during a call (kernels only; back to 0 when a call ends); ``stats``
    counts digests stamped and verified, selected verify tiles skipped over capacity, and calls;
    ``epoch`` advances once per budgeted verify and rotates which positions it selects.
    """

    acc: torch.Tensor  # int64 [entries]
    entry_slots: torch.Tensor  # int64 [entries]: each entry's slot, -1 (skipped) or -2 (out of range) (kernels)
    entry_info: torch.Tensor  # int64 [entries]: batch row << 32 | position, or the list's value (kernels)
    sync: torch.Tensor  # int64 [4]: pending violations, finished programs (kernels)
    epoch: torch.Tensor  # int64 [1]
    stats: torch.Tensor  # int64 [4]: see the STAT_* indices

    STAT_STAMPED = 0
    STAT_VERIFIED = 1
    STAT_SKIPPED_TILES = 2
    STAT_CALLS = 3

    @classmethod
    def allocate(cls, entries: int, device: torch.device | str = "cpu") -> DigestWorkspace:
        if isinstance(entries, bool) or not isinstance(entries, int) or entries <= 0:
            raise ValueError(f"digest entries must be a positive int, got {entries!r}")

        def i64(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int64, device=device)

        return cls(
            acc=i64(entries),
            entry_slots=i64(entries),
            entry_info=i64(entries),
            sync=i64(4),
            epoch=i64(1),
            stats=i64(4),
        )

    @property
    def entries(self) -> int:
        return int(self.acc.shape[0])
