"""Translate an sglang ``ForwardBatch`` into one :class:`~kvcanary.StepBatch` per canary group.

Per forward mode (``prefix`` = tokens already cached, ``extend`` = tokens written this forward):

========================  ====================================  ==========================
mode                      prefix                                extend
========================  ====================================  ==========================
EXTEND, MIXED             ``extend_prefix_lens``                ``extend_seq_lens``
DECODE (target)           ``seq_lens - 1``                      1
DECODE (draft worker)     ``positions`` (EAGLE draft steps      1
                          leave ``seq_lens`` un-bumped)
TARGET_VERIFY (EAGLE)     ``seq_lens``                          ``spec_info.draft_token_num``
DRAFT_EXTEND_V2           ``seq_lens - extend_seq_lens``        ``extend_seq_lens``
IDLE                      (no rows)
========================  ====================================  ==========================

Target decode takes its prefix from ``seq_lens`` rather than ``positions`` so that the stamp's
write-position check compares two independent sources.  Every derived value is written in place into
buffers allocated once (sized by the capacities), so the translation is CUDA-graph capturable: only
shapes are read on the host, never values.

A sliding-window group gets the same batch with the pool's full->window mapping as its lookup, and
an ``out_cache_loc`` in which tokens whose full slot maps to window slot 0 (no window slot: sglang's
tail-only window allocation writes those into the padding slot) are marked not stored (-1).  A
within-window token that lost its mapping is still caught, by the next forward's verify.
"""

from __future__ import annotations

import torch

from kvcanary.adapters.sglang.pools import AttachedPool
from kvcanary.adapters.sglang.truth import TruthTable
from kvcanary.batch import StepBatch
from kvcanary.schema import NOT_STORED

EXTEND_MODES = ("EXTEND", "MIXED")
SUPPORTED_MODES = ("EXTEND", "MIXED", "DECODE", "IDLE", "TARGET_VERIFY", "DRAFT_EXTEND_V2")
_INDEX_DTYPES = (torch.int32, torch.int64)


def mode_name(forward_batch: object) -> str:
    mode = getattr(forward_batch, "forward_mode", None)
    name = getattr(mode, "name", None)
    if not isinstance(name, str):
        raise TypeError(f"forward_batch.forward_mode must be an sglang ForwardMode, got {mode!r}")
    return name


class ForwardTranslator:
    """Builds the per-group batches of one forward into persistent buffers."""

    def __init__(
        self,
        attached: AttachedPool,
        table: torch.Tensor,
        *,
        max_batch: int,
        max_tokens: int,
        draft: bool,
    ) -> None:
        if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.dtype not in _INDEX_DTYPES:
            raise TypeError(f"req_to_token must be a 2-D int32/int64 tensor, got {table!r:.80}")
        self.attached = attached
        self.table = table
        self.device = table.device
        self.max_batch = max_batch
        self.max_tokens = max_tokens
        self.draft = draft
        self.truth = TruthTable(table, max_batch)

        def i64(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int64, device=self.device)

        self._rows = i64(max_batch)
        self._seq = i64(max_batch)
        self._prefix = i64(max_batch)
        self._extend = i64(max_batch)
        self._ones = torch.ones(max_batch, dtype=torch.int64, device=self.device)
        self._tokens = [i64(max_tokens) for _ in range(3)]  # input_ids, positions, out_cache_loc when copied
        self._win_idx = i64(max_tokens)
        self._win_val = i64(max_tokens)
        self._win_loc = i64(max_tokens)
        self._win_mask = torch.zeros(max_tokens, dtype=torch.bool, device=self.device)
        self._win_same = torch.zeros(max_tokens, dtype=torch.bool, device=self.device)

    # ------------------------------------------------------------------ helpers

    def _index(self, value: object, name: str, n: int, buf: torch.Tensor) -> torch.Tensor:
        """The first ``n`` entries of a 1-D index tensor, as is when usable, else copied into ``buf``."""
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"forward_batch.{name} must be a torch.Tensor, got {type(value).__name__}")
        if value.dim() != 1 or value.shape[0] < n:
            raise ValueError(f"forward_batch.{name} has shape {tuple(value.shape)}, expected at least {n} entries")
        if value.device != self.device:
            raise ValueError(f"forward_batch.{name} is on {value.device}, the canary on {self.device}")
        view = value[:n]
        if view.dtype in _INDEX_DTYPES and view.is_contiguous():
            return view
        if value.dtype.is_floating_point or value.dtype == torch.bool:
            raise TypeError(f"forward_batch.{name} must hold integers, got {value.dtype}")
        out = buf[:n]
        out.copy_(view)
        return out

    def _check_sizes(self, bs: int, n: int, mode: str) -> None:
        if bs > self.max_batch:
            raise ValueError(f"{mode} batch has {bs} rows, more than the canary's max_batch={self.max_batch}")
        if n > self.max_tokens:
            raise ValueError(f"{mode} batch has {n} tokens, more than the canary's max_tokens={self.max_tokens}")

    # ------------------------------------------------------------------ the translation

    def lengths(self, fb: object, mode: str, bs: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(prefix_lens, extend_lens) of the batch rows, per the module table."""
        if mode in EXTEND_MODES:
            prefix = self._index(getattr(fb, "extend_prefix_lens", None), "extend_prefix_lens", bs, self._prefix)
            extend = self._index(getattr(fb, "extend_seq_lens", None), "extend_seq_lens", bs, self._extend)
            return prefix, extend
        if mode == "DECODE":
            if self.draft:
                if positions.shape[0] < bs:
                    raise ValueError(f"draft decode has {positions.shape[0]} positions for {bs} rows")
                return positions[:bs], self._ones[:bs]
            seq = self._index(getattr(fb, "seq_lens", None), "seq_lens", bs, self._seq)
            prefix = self._prefix[:bs]
            torch.sub(seq, 1, out=prefix)
            return prefix, self._ones[:bs]
        if mode == "TARGET_VERIFY":
            spec = getattr(fb, "spec_info", None)
            draft_tokens = getattr(spec, "draft_token_num", None)
            if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or draft_tokens <= 0:
                raise ValueError(f"TARGET_VERIFY needs spec_info.draft_token_num > 0, got {draft_tokens!r}")
            topk = getattr(spec, "topk", 1)
            if isinstance(topk, int) and topk > 1:
                raise ValueError(
                    f"EAGLE tree verification (topk={topk}) is not supported: the canary checks linear "
                    "chains; run with --speculative-eagle-topk 1 or --kv-canary none"
                )
            prefix = self._index(getattr(fb, "seq_lens", None), "seq_lens", bs, self._prefix)
            extend = self._extend[:bs]
            extend.fill_(draft_tokens)
            return prefix, extend
        if mode == "DRAFT_EXTEND_V2":
            seq = self._index(getattr(fb, "seq_lens", None), "seq_lens", bs, self._seq)
            extend = self._index(getattr(fb, "extend_seq_lens", None), "extend_seq_lens", bs, self._extend)
            prefix = self._prefix[:bs]
            torch.sub(seq, extend, out=prefix)
            return prefix, extend
        raise ValueError(f"forward mode {mode} is not supported by the canary; supported: {', '.join(SUPPORTED_MODES)}")

    def translate(self, fb: object) -> dict[str, StepBatch]:
        """One StepBatch per group of the attached pool (group name -> batch)."""
        mode = mode_name(fb)
        if mode not in SUPPORTED_MODES:
            raise ValueError(
                f"forward mode {mode} is not supported by the canary; supported: {', '.join(SUPPORTED_MODES)}"
            )
        bs = 0 if mode == "IDLE" else getattr(fb, "batch_size", None)
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 0:
            raise TypeError(f"forward_batch.batch_size must be a non-negative int, got {bs!r}")
        ids_t = getattr(fb, "input_ids", None)
        n = 0 if mode == "IDLE" or not isinstance(ids_t, torch.Tensor) else int(ids_t.shape[0])
        self._check_sizes(bs, n, mode)
        if mode == "IDLE":
            empty = self._ones[:0]
            rows, prefix, extend = self._rows[:0], self._prefix[:0], self._extend[:0]
            ids, positions, loc = empty, empty, empty
        else:
            ids = self._index(ids_t, "input_ids", n, self._tokens[0])
            positions = self._index(getattr(fb, "positions", None), "positions", n, self._tokens[1])
            loc = self._index(getattr(fb, "out_cache_loc", None), "out_cache_loc", n, self._tokens[2])
            rows = self._index(getattr(fb, "req_pool_indices", None), "req_pool_indices", bs, self._rows)
            prefix, extend = self.lengths(fb, mode, bs, positions)
        groups = self.attached.groups
        truth = {"truth": self.truth.truth, "truth_lens": self.truth.lens[: rows.shape[0]]}  # see truth.py
        out = {groups[0].name: StepBatch(rows, prefix, extend, self.table, ids, positions, loc, **truth)}
        if self.attached.window_group is not None:
            lookup = self.attached.lookup()
            window_loc = self._window_loc(loc, lookup)
            out[self.attached.window_group] = StepBatch(
                rows, prefix, extend, self.table, ids, positions, window_loc, lookup=lookup, **truth
            )
        return out

    def _window_loc(self, loc: torch.Tensor, lookup: torch.Tensor) -> torch.Tensor:
        """``loc`` with tokens that have no window slot (mapping 0) marked NOT_STORED; in place, no host reads.

        Out-of-range full slots are left as they are so the core reports them (lookup_out_of_range).
        """
        n = int(loc.shape[0])
        if n == 0:
            return loc
        idx, val, out = self._win_idx[:n], self._win_val[:n], self._win_loc[:n]
        unmapped, in_range = self._win_mask[:n], self._win_same[:n]
        torch.clamp(loc, 0, int(lookup.shape[0]) - 1, out=idx)
        torch.index_select(lookup, 0, idx, out=val)
        torch.eq(val, 0, out=unmapped)
        torch.eq(idx, loc, out=in_range)  # clamping changed nothing: loc was inside the lookup table
        unmapped.logical_and_(in_range)
        out.copy_(loc)
        out.masked_fill_(unmapped, NOT_STORED)
        return out
