"""One group's read-index translation in a single Triton launch (CUDA; the interpreter in tests).

Replaces the two dozen small torch ops of :meth:`.translate.StepTranslator._from_read_index` -- each a
launch with microseconds of Python on the host -- with one kernel
(:mod:`kvcanary.ops.kernels.translate`), whose results are the same tensors byte for byte: the table
cells and ``out_cache_loc`` (written straight into the caller's buffer).  It covers the common case: a
step whose rows have read segments (``cu_seq_lens_k`` long enough, a non-empty read index) or no verified
entry at all; the rest (a batch of first chunks with no read index, a short ``cu_seq_lens_k``) stays on
the torch path.  Nothing is read back and nothing allocated.
"""

from __future__ import annotations

import torch

from kvcanary.adapters.transformers_cb.geometry import GroupGeometry

BLOCK = 512


def launch(
    g: GroupGeometry,
    *,
    write: torch.Tensor,
    trash: torch.Tensor | None,
    out: torch.Tensor,
    read: torch.Tensor,
    cu_k: torch.Tensor,
    entries: dict[str, torch.Tensor] | None,
    edges: torch.Tensor | None,
    cells: torch.Tensor,
) -> None:
    """``out`` (n_tok) and ``cells`` (the flat table) are written; ``entries``: expected, row, offset, cells."""
    from kvcanary.ops.kernels.translate import translate_kernel

    n_tok, n_write = int(out.shape[0]), int(write.shape[0])
    n_entries = 0 if entries is None else int(entries["row"].shape[0])
    n_edges = 0 if edges is None else int(edges.shape[0])
    dummy = out
    e = entries or {}
    grid = (max(1, -(-max(n_tok, n_entries, n_edges) // BLOCK)),)
    translate_kernel[grid](
        _ptr(write, dummy), _ptr(trash, dummy), out,
        _ptr(read, dummy), _ptr(cu_k, dummy), _ptr(e.get("expected"), dummy), _ptr(e.get("row"), dummy),
        _ptr(e.get("offset"), dummy), _ptr(e.get("cells"), dummy), _ptr(edges, dummy), cells,
        n_tok, n_write, n_entries, int(read.shape[0]), n_edges,
        g.stride, g.page_size, g.num_blocks * g.stride, g.sentinel_index, g.sentinel_slot, g.invalid_slot,
        g.read_trash_slot, g.write_trash_index,
        HAS_TRASH=trash is not None, BLOCK=BLOCK,
    )  # fmt: skip


def _ptr(t: torch.Tensor | None, dummy: torch.Tensor) -> torch.Tensor:
    """The tensor, or a stand-in where it is absent or empty (its loads are all masked off then)."""
    return dummy if t is None or t.numel() == 0 else t
