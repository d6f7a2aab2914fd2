"""Ground truth for sglang: each request's ``origin_input_ids + output_ids``, by ``req_to_token`` row.

sglang 0.5.23's ``ForwardBatch.init_new`` snapshots exactly these ids when
``SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT=1``: ``req_all_ids_flat`` (pinned CPU int64, the
batch's requests concatenated) and ``req_all_ids_lens`` (one length per batch row).  :meth:`fill`
scatters them into a table shaped like ``req_to_token`` (allocated once, int32) and sets the
per-row valid lengths the canary's batches point at; without the snapshot the lengths are zero
and token checks are off for that forward (never compared against another forward's ids).

Cost per forward: one host->device copy of the snapshot and one scatter, O(the batch's context),
the order of the verification the canary does anyway; no host reads of device values.  It runs
outside any CUDA graph (before the replay), so the graph reads the buffers as filled.
"""

from __future__ import annotations

import torch

_INT_DTYPES = (torch.int32, torch.int64)


class TruthTable:
    def __init__(self, table: torch.Tensor, max_batch: int) -> None:
        self.device = table.device
        self.width = int(table.shape[1])
        self.truth = torch.zeros(tuple(table.shape), dtype=torch.int32, device=self.device)
        self.lens = torch.zeros(max_batch, dtype=torch.int64, device=self.device)
        self._filled_for: object | None = None
        self._filled_ids: object | None = None  # the snapshot tensor last loaded
        self.filled_forwards = 0

    def clear(self) -> None:
        """Forget the last snapshot: a forward that brings none is not checked against it."""
        self.lens.zero_()
        self._filled_for = None
        self._filled_ids = None

    def fill(self, fb: object) -> bool:
        """Load ``fb``'s snapshot (once per ForwardBatch object); False when it carries none."""
        flat = getattr(fb, "req_all_ids_flat", None)
        lens = getattr(fb, "req_all_ids_lens", None)
        # The runner's forward and the model's may get different ForwardBatch objects over one snapshot
        # (sglang's eager runner passes a copy): load it once.
        if fb is self._filled_for or (flat is not None and flat is self._filled_ids):
            return True
        if flat is None or lens is None:
            self.clear()
            return False
        rows = getattr(fb, "req_pool_indices", None)
        bs = _check_snapshot(flat, lens, rows, self.lens.shape[0])
        self.lens.zero_()
        if bs:
            self._scatter(flat, lens, rows[:bs])  # type: ignore[index]
        self._filled_for = fb
        self._filled_ids = flat
        self.filled_forwards += 1
        return True

    def _scatter(self, flat: torch.Tensor, lens: torch.Tensor, rows: torch.Tensor) -> None:
        lens_cpu = lens.to(torch.int64)
        total = int(lens_cpu.sum())
        dev = self.device
        lens_dev = lens_cpu.to(dev, non_blocking=True)
        starts = (torch.cumsum(lens_cpu, 0) - lens_cpu).to(dev, non_blocking=True)
        row_of = torch.repeat_interleave(rows.to(torch.int64), lens_dev, output_size=total)
        col = torch.arange(total, device=dev) - torch.repeat_interleave(starts, lens_dev, output_size=total)
        ids = flat.to(dev, non_blocking=True)
        if bool((lens_cpu > self.width).any()):  # host values: ids past the table width have no position
            keep = col < self.width
            row_of, col, ids = row_of[keep], col[keep], ids[keep]
        # A corrupt req_pool_index is the plan's row_out_of_range, never a bad index here: park it on
        # the padding row 0, which is never verified.
        row_of = torch.where((row_of >= 0) & (row_of < self.truth.shape[0]), row_of, 0)
        self.truth.view(-1).index_copy_(0, row_of * self.width + col, ids.to(torch.int32))  # flat: cheapest scatter
        self.lens[: lens_cpu.shape[0]].copy_(lens_dev.clamp(max=self.width))


def _check_snapshot(flat: object, lens: object, rows: object, max_batch: int) -> int:
    for name, t in (("req_all_ids_flat", flat), ("req_all_ids_lens", lens)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in _INT_DTYPES:
            raise TypeError(f"forward_batch.{name} must be a 1-D int tensor, got {t!r:.80}")
        if t.device.type != "cpu":
            raise ValueError(f"forward_batch.{name} must be on the CPU (sglang's pinned snapshot), got {t.device}")
    assert isinstance(flat, torch.Tensor) and isinstance(lens, torch.Tensor)
    bs = int(lens.shape[0])
    if not isinstance(rows, torch.Tensor) or rows.dim() != 1 or rows.shape[0] < bs:
        raise ValueError(f"forward_batch.req_all_ids_lens has {bs} entries, req_pool_indices does not match")
    if bs > max_batch:
        raise ValueError(f"forward_batch.req_all_ids_lens has {bs} entries, more than max_batch={max_batch}")
    if bool((lens < 0).any()) or int(lens.sum()) != int(flat.shape[0]):
        raise ValueError(
            f"forward_batch.req_all_ids_lens (sum {int(lens.sum())}) does not describe req_all_ids_flat "
            f"({int(flat.shape[0])} ids)"
        )
    return bs
