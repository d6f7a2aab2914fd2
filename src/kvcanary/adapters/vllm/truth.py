"""Ground truth: the token ids each request of the step really holds, by batch row.

The source is the model runner's own request state (``CachedRequestState``: ``prompt_token_ids`` +
``output_token_ids``), kept apart from ``input_batch.token_ids_cpu`` from which vLLM gathers the forward's
``input_ids``: a corrupted id there is a ``token_mismatch``.  The host buffer is indexed by batch row (the
table row of :mod:`.translate`) and filled incrementally: a row is refilled when another request moves in,
otherwise only its new tokens are copied.  Positions at or beyond ``width`` and placeholders (-1, async
scheduling) are unknown, so they are not checked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch


class TruthTable:
    def __init__(self, max_rows: int, width: int, device: torch.device) -> None:
        self.width = max(width, 1)
        self._host = np.full((max_rows, self.width), -1, dtype=np.int32)
        self._lens = np.zeros(max_rows, dtype=np.int32)
        self._owner: list[object | None] = [None] * max_rows
        self._device = device
        self.truth = torch.from_numpy(self._host) if device.type == "cpu" else torch.empty(0, device=device)
        self.lens = torch.from_numpy(self._lens) if device.type == "cpu" else torch.empty(0, device=device)

    def fill(self, req_ids: Sequence[str | None], requests: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Bring the rows of ``req_ids`` up to date; returns (truth, truth_lens) on the canary's device."""
        for row, rid in enumerate(req_ids):
            state = requests.get(rid) if rid is not None else None
            if state is None:
                self._owner[row], self._lens[row] = None, 0
                continue
            self._fill_row(row, state)
        n = len(req_ids)
        if self._device.type == "cpu":
            return self.truth, self.lens
        width = max(int(self._lens[:n].max()), 1) if n else 1  # only the step's rows and known positions travel
        host = np.ascontiguousarray(self._host[: max(n, 1), :width])
        return torch.from_numpy(host).to(self._device), torch.from_numpy(self._lens[:n].copy()).to(self._device)

    def _fill_row(self, row: int, state: Any) -> None:
        prompt = state.prompt_token_ids
        if prompt is None:  # prompt embeddings: positions are not token ids, nothing to compare
            self._owner[row], self._lens[row] = state, 0
            return
        output = state.output_token_ids
        n = min(len(prompt) + len(output), self.width)
        start = int(self._lens[row])
        if self._owner[row] is not state or n < start:
            self._owner[row], start = state, 0
        if n > start:
            buf = self._host[row]
            p = len(prompt)
            if start < p:
                end = min(p, n)
                buf[start:end] = prompt[start:end]
            if n > p:
                buf[max(start, p) : n] = output[max(start, p) - p : n - p]
        self._lens[row] = n
