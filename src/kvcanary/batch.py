"""The canonical batch an adapter fills for one group each forward step.

Per batch row r: the request's table row ``rows[r]``, ``prefix_lens[r]`` tokens already in the cache
and ``extend_lens[r]`` tokens written this step.  Per token of the step (flattened in batch-row
order, ``extend_lens`` consecutive tokens per row): ``input_ids``, ``positions`` and ``out_cache_loc``
(the slot written, in the table's index space).  Optional ground truth: ``truth[table_row, pos]``
holds the token the scheduler believes sits at ``pos``, valid below ``truth_lens[r]``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvcanary.layout import CanaryGroup

_INDEX_DTYPES = (torch.int32, torch.int64)


@dataclasses.dataclass
class StepBatch:
    rows: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    table: torch.Tensor
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    truth: torch.Tensor | None = None
    truth_lens: torch.Tensor | None = None
    lookup: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.rows.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def tensors(self) -> dict[str, torch.Tensor | None]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def to(self, device: torch.device | str) -> StepBatch:
        """This batch with every tensor on ``device`` (a copy where it moves, as ``Tensor.to``)."""
        moved: dict[str, Any] = {k: None if v is None else v.to(device) for k, v in self.tensors().items()}
        return StepBatch(**moved)


def _check_tensor(name: str, t: object, ndim: int, device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return t


def validate_batch(
    batch: StepBatch,
    group: CanaryGroup,
    *,
    device: torch.device,
    max_batch: int,
    max_tokens: int,
    check_values: bool,
    engine_values: bool = True,
) -> None:
    """Raise ``TypeError``/``ValueError`` naming the argument if ``batch`` breaks the contract.

    Metadata (dtype, shape, device, capacities, the ground truth's shape) is always checked.  Values
    are checked when ``check_values`` is set; this reads the tensors on the host, so the per-step GPU
    path leaves it off.  Two kinds of values: the ground truth's lengths are the adapter's own
    claim, so a bad one is API misuse and raises; lengths and rows come from the engine's state,
    which the plan turns into violations (``row_out_of_range``, ``length_out_of_range``), so with
    ``engine_values=False`` (the manager's choice: a corrupt engine is reported, never raised) they
    are left to it.
    """
    bs = _check_tensor("rows", batch.rows, 1, device).shape[0]
    for name in ("prefix_lens", "extend_lens"):
        if _check_tensor(name, getattr(batch, name), 1, device).shape[0] != bs:
            raise ValueError(f"{name} has {getattr(batch, name).shape[0]} entries, rows has {bs}")
    if _check_tensor("table", batch.table, 2, device).shape[1] * group.page_size >= 2**31:
        # The kernels page positions in 32 bits (kernels/indexing.py: the int64 division cost a call a lane).
        raise ValueError(
            f"table rows span {batch.table.shape[1]} x {group.page_size} positions (columns x page size); "
            "at most 2**31 - 1 are supported"
        )
    n = _check_tensor("input_ids", batch.input_ids, 1, device).shape[0]
    for name in ("positions", "out_cache_loc"):
        if _check_tensor(name, getattr(batch, name), 1, device).shape[0] != n:
            raise ValueError(f"{name} has {getattr(batch, name).shape[0]} entries, input_ids has {n}")
    if bs > max_batch:
        raise ValueError(f"batch has {bs} rows, more than the declared capacity max_batch={max_batch}")
    if n > max_tokens:
        raise ValueError(f"batch has {n} tokens, more than the declared capacity max_tokens={max_tokens}")
    if (batch.truth is None) != (batch.truth_lens is None):
        raise ValueError("truth and truth_lens must be given together")
    if batch.truth is not None:
        _check_truth_shape(batch, device, bs)
    if group.uses_lookup and batch.lookup is None:
        raise ValueError(f"group {group.name!r} uses a lookup table but the batch has none")
    if not group.uses_lookup and batch.lookup is not None:
        raise ValueError(f"group {group.name!r} takes no lookup table but the batch has one")
    if batch.lookup is not None:
        _check_tensor("lookup", batch.lookup, 1, device)
    if check_values:
        _check_truth_values(batch, group)
        if engine_values:
            _check_values(batch, group)


def _check_truth_shape(batch: StepBatch, device: torch.device, bs: int) -> None:
    # Truth is indexed by table row: a shorter one would silently switch token checks off for the rest.
    truth = _check_tensor("truth", batch.truth, 2, device)
    lens = _check_tensor("truth_lens", batch.truth_lens, 1, device)
    if lens.shape[0] != bs:
        raise ValueError(f"truth_lens has {lens.shape[0]} entries, rows has {bs}")
    if truth.shape[0] == 0 and bs > 0:
        raise ValueError("truth has no rows: it is indexed by table row, like the table")


def _check_truth_values(batch: StepBatch, group: CanaryGroup) -> None:
    """The truth must cover what it claims: every live row's table row and ``truth_lens`` columns."""
    if batch.truth is None or batch.truth_lens is None:
        return
    rows = batch.rows.long()
    in_table = (rows >= 0) & (rows < batch.table.shape[0])  # rows outside the table are the plan's violations
    if group.padding_row is not None:
        in_table &= rows != group.padding_row
    uncovered = in_table & (rows >= batch.truth.shape[0])
    if bool(uncovered.any()):
        raise ValueError(
            f"truth has {batch.truth.shape[0]} rows, but batch rows {_where(uncovered)} use table rows "
            f"{[int(v) for v in rows[uncovered][:8]]}: it is indexed by table row, like the table"
        )
    lens = batch.truth_lens
    if bool((lens < 0).any()):
        raise ValueError(f"truth_lens has negative entries at batch rows {_where(lens < 0)}")
    width = int(batch.truth.shape[1])
    beyond = lens > width
    if bool(beyond.any()):
        raise ValueError(
            f"truth_lens exceeds the truth's width {width} at batch rows {_where(beyond)} "
            f"(values {[int(v) for v in lens[beyond][:8]]}): the truth holds no tokens there"
        )


def _check_values(batch: StepBatch, group: CanaryGroup) -> None:
    rows = batch.rows.long()
    prefix = batch.prefix_lens.long()
    extend = batch.extend_lens.long()
    live = torch.ones_like(rows, dtype=torch.bool)
    if group.padding_row is not None:
        live = rows != group.padding_row
    if bool((prefix < 0).any()):
        raise ValueError(f"prefix_lens has negative entries at batch rows {_where(prefix < 0)}")
    if bool((extend < 0).any()):
        raise ValueError(f"extend_lens has negative entries at batch rows {_where(extend < 0)}")
    n_rows = batch.table.shape[0]
    bad = live & ((rows < 0) | (rows >= n_rows))
    if bool(bad.any()):
        raise ValueError(f"rows has entries outside the table's {n_rows} rows at batch rows {_where(bad)}")
    width = batch.table.shape[1] * group.page_size
    too_long = live & (prefix + extend > width)
    if bool(too_long.any()):
        raise ValueError(f"prefix_lens + extend_lens exceeds the table width {width} at batch rows {_where(too_long)}")
    total = int(extend.sum())
    if total > batch.num_tokens:
        raise ValueError(f"extend_lens sums to {total} tokens, but input_ids holds {batch.num_tokens}")


def _where(mask: torch.Tensor) -> list[int]:
    return [int(i) for i in mask.nonzero().flatten()[:8]]
