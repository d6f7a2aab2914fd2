"""The outbox published by the step's device work into host buffers the device writes directly.

The lagged pump (:mod:`.pump`) normally copies the outbox into host buffer ``k % 3`` at host step ``k`` and records
an event behind the copy; host step ``k + 1`` queries that event. With a publisher, the step's device work ends with
one launch (``ops/kernels/outbox_publish.py``) that writes the outbox into buffer ``seq % 4`` (see
:data:`NUM_BUFFERS`) and sets that buffer's flag to ``seq + 1``; on CUDA it joins the canary's step graph, so a
steady host step makes none of those three CUDA calls and reads the flag from memory. ``seq`` counts the publishes
on the device; each host step publishes exactly once (in its step graph, else at its host step), so ``seq`` is the
host step's index.

The host reads a flag and then the buffer; the kernel's system-scope release orders the buffer's bytes before the flag
on the device's side, and the host's loads stay in order only on a CPU that keeps loads in program order (x86-64): the
manager publishes only there (and on the CPU, for tests).
"""

from __future__ import annotations

import functools
import platform
from collections.abc import Callable

import torch

# Host buffers written in turn.  One more than the copying pump's three: a step's publish is queued by its
# forward, before its host step decodes the step two back, so the buffer it writes must be none of the last three
# steps' (the two not yet decoded, and the last decoded, whose totals the decoder keeps reading).
NUM_BUFFERS = 4
_LOADS_IN_ORDER = ("x86_64", "AMD64", "i386", "i686")


def can_publish(device: torch.device) -> bool:
    """Whether host memory the device writes can be read this way here (see the module docstring)."""
    return device.type == "cpu" or platform.machine() in _LOADS_IN_ORDER


class OutboxPublisher:
    """The launch that publishes ``outbox`` into ``block`` (``[NUM_BUFFERS, outbox size]``, pinned on CUDA) and sets
    ``flags`` (``[NUM_BUFFERS]`` int64, pinned on CUDA), its arguments bound once."""

    BLOCK = 1024  # outbox words per program

    def __init__(self, outbox: torch.Tensor, block: torch.Tensor, flags: torch.Tensor) -> None:
        size = outbox.numel()
        if block.shape != (NUM_BUFFERS, size) or flags.shape != (NUM_BUFFERS,):
            raise ValueError(f"publish: block must be [{NUM_BUFFERS}, {size}] and flags [{NUM_BUFFERS}]")
        from kvcanary.ops.kernels.outbox_publish import outbox_publish_kernel

        self.state = torch.zeros(2, dtype=torch.int64, device=outbox.device)  # [seq, ticket]
        grid = (-(-size // self.BLOCK),)
        self.launch: Callable[[], None] = functools.partial(
            outbox_publish_kernel[grid], outbox, block, flags, self.state, size,
            NUM_BUFFERS=NUM_BUFFERS, BLOCK=self.BLOCK,
        )  # fmt: skip


def publish_reference(outbox: torch.Tensor, block: torch.Tensor, flags: torch.Tensor, state: torch.Tensor) -> None:
    """The kernel's spec, as torch ops on the CPU: the outbox into buffer ``seq % NUM_BUFFERS``, its flag
    ``seq + 1``, ``seq`` counted on (``state``: ``[seq, ticket]``, the ticket left at zero)."""
    seq = int(state[0])
    slot = seq % NUM_BUFFERS
    block[slot].copy_(outbox)
    flags[slot] = seq + 1
    state[0] = seq + 1
