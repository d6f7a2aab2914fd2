"""One group's read-index translation in a single Triton launch (CUDA; the interpreter in tests).

Replaces the two dozen small torch ops of :meth:`.translate.StepTranslator._from_read_index` -- each a
launch with microseconds of Python on the host -- with one kernel (:mod:`kvcanary.ops.kernels.translate`)
whose results are the same tensors byte for byte: the table cells and ``out_cache_loc`` (written straight
into the caller's buffer).  The kernel expands each row's span from its lengths itself, so the host sends
nothing per verified entry, and it reads the step's sizes from a device array: a :class:`GroupLaunch`
keeps its arguments and can be run again, which is how the translation joins the canary's own step graph
(:class:`kvcanary.runtime.step_graphs.Prelude`).  It covers the common case: a step whose rows have read
segments (``cu_seq_lens_k`` long enough, a non-empty read index) or no verified entry at all; the rest (a
batch of first chunks with no read index, a short ``cu_seq_lens_k``) stays on the torch path.  Nothing
is read back and nothing allocated.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from kvcanary.adapters.transformers_cb.batch_shapes import flat
from kvcanary.adapters.transformers_cb.geometry import GroupGeometry
from kvcanary.adapters.transformers_cb.step_plan import RowPlan

BLOCK = 512


@dataclasses.dataclass(frozen=True)
class GroupLaunch:
    """One group's translation launch with its arguments bound."""

    args: tuple[Any, ...]
    grid: tuple[int]
    constexprs: dict[str, Any]

    @classmethod
    def bind(
        cls,
        g: GroupGeometry,
        kwargs: Mapping[str, Any],
        *,
        trash: torch.Tensor | None,
        out: torch.Tensor,
        lengths: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        sizes: torch.Tensor,
        cells: torch.Tensor,
        width: int,
        tokens: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> GroupLaunch:
        """``out`` (n_tok) and ``cells`` (the flat ``(rows, width)`` table) are written.  ``kwargs``: the forward's,
        whose write index, read index and key offsets of the group the launch reads as attention received them.
        ``lengths``: the batch's table rows (0: left out), past and query lengths; ``sizes``: the write and read
        indices' lengths and the forward's token count (device int64).  ``tokens``: the engine's contiguous token
        ids and positions, and the int64 buffers (at least ``out``'s length) this launch copies them into."""
        write, read = flat(kwargs["write_index"][g.index]), flat(kwargs["read_index"][g.index])
        cu_k = flat(kwargs["cu_seq_lens_k"][g.name])
        rows = lengths[0]
        n_tok, n_rows = int(out.shape[0]), int(rows.shape[0])
        chunks = max(1, -(-width // BLOCK))
        args = (
            _ptr(write, out), _ptr(trash, out), out, _ptr(read, out), _ptr(cu_k, out), *lengths, sizes, cells,
            *(tokens or (out,) * 4), n_tok, width, g.canary_window, *g.slot_map,
        )  # fmt: skip
        grid = (-(-n_tok // BLOCK) + n_rows * chunks,)
        consts = {"SLIDING": g.is_sliding, "HAS_TRASH": trash is not None, "CHUNKS": chunks, "BLOCK": BLOCK,
                  "COPY_TOKENS": tokens is not None}  # fmt: skip
        return cls(args, grid, consts)

    @property
    def key(self) -> tuple[object, ...]:
        """Everything the launch bakes in: each tensor's address and dtype, each scalar, the grid."""
        return (
            *((a.data_ptr(), a.dtype) if isinstance(a, torch.Tensor) else a for a in self.args),
            self.grid,
            tuple(self.constexprs.values()),
        )

    def run(self) -> None:
        from kvcanary.ops.kernels.translate import translate_kernel

        translate_kernel[self.grid](*self.args, **self.constexprs)


class Launch(Protocol):
    """Device work bound to its tensors: ``key`` names what it bakes in, ``run`` issues it."""

    @property
    def key(self) -> tuple[object, ...]: ...

    def run(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class Launches:
    """A step's translation work (the truth update, the group launches), run in order (a
    :class:`~kvcanary.runtime.step_graphs.Prelude`)."""

    launches: tuple[Launch, ...]

    @functools.cached_property
    def key(self) -> tuple[object, ...]:
        """Computed once: each launch's arguments are bound for good (a steady step runs these launches again)."""
        return tuple(launch.key for launch in self.launches)

    def run(self) -> None:
        for launch in self.launches:
            launch.run()


def _ptr(t: torch.Tensor | None, dummy: torch.Tensor) -> torch.Tensor:
    """The tensor, or a stand-in where it is absent or empty (its loads are all masked off then)."""
    return dummy if t is None or t.numel() == 0 else t


def token_copy(
    kwargs: Mapping[str, Any], input_ids: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The engine's token tensors (contiguous: the launch reads them as flat memory) and the buffers they go to."""
    ids, pos = kwargs["input_ids"], kwargs["position_ids"]
    ids = ids if ids.is_contiguous() else flat(ids).contiguous()
    pos = pos if pos.is_contiguous() else flat(pos).contiguous()
    return ids, pos, input_ids, positions


def covers(g: GroupGeometry, rows: RowPlan, kwargs: Mapping[str, Any], n_read: int) -> bool:
    """The kernel's case: no verified entry, or read segments to gather them from."""
    if not rows.reads_or_writes:  # every group's span is empty (a window reads at least the query)
        return True
    cu_k = kwargs["cu_seq_lens_k"][g.name]
    return n_read > 0 and int(cu_k.shape[-1]) >= rows.size + 1
