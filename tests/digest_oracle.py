"""An independent scalar statement of the KV digest (design.md §12), on Python ints and raw bytes.

Shares no code with the library beyond the two constants: its own SplitMix64 finaliser, and bytes taken
one head row at a time through plain indexing of the component's view.
"""

from __future__ import annotations

import torch

from kvcanary.digest import DIGEST_GAMMA, DIGEST_SEED, DigestLayout

M64 = (1 << 64) - 1


def splitmix_finalize(x: int) -> int:
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & M64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & M64
    return x ^ (x >> 31)


def head_row_bytes(view: torch.Tensor, slot: int, head: int) -> bytes:
    block, offset = divmod(slot, view.shape[1])
    out = b""
    for d in range(view.shape[3]):  # element by element, whatever the strides
        out += bytes(view[block, offset, head, d].reshape(1).contiguous().view(torch.uint8).tolist())
    return out


def slot_digest(layout: DigestLayout, slot: int) -> int:
    """The digest as a signed int64 value (the way it is stored)."""
    total, index = 0, 0
    for comp in layout.components:
        for head in range(comp.view.shape[2]):
            row = head_row_bytes(comp.view, slot, head)
            row += bytes(-len(row) % 8)
            for k in range(0, len(row), 8):
                word = int.from_bytes(row[k : k + 8], "little")
                key = splitmix_finalize((DIGEST_SEED + (index + 1) * DIGEST_GAMMA) & M64)
                total = (total + splitmix_finalize(word ^ key)) & M64
                index += 1
    value = total | 1
    return value - (1 << 64) if value >> 63 else value
