"""The storm's input probe: every record of the pool scrambled before each verified step, and what the
scheduler says each step reads (the independent count the storm tests compare reports with)."""

from __future__ import annotations

from typing import Any

import torch

from kvcanary.adapters.transformers_cb.adapter import TransformersCBAdapter

STORM_FROM = 1  # canary step of the first corrupt forward


class StormProbe:
    """Scrambles every record before each verified step and notes what the scheduler says is read."""

    def __init__(self, adapter: TransformersCBAdapter) -> None:
        self.adapter = adapter
        self.gen = torch.Generator().manual_seed(0)
        self.expected: dict[int, list[tuple[int, int]]] = {}  # step -> (batch row, position) read, in order
        self.request_ids: dict[int, tuple[str, ...]] = {}

    def __call__(self, kwargs: dict[str, Any]) -> None:
        host, manager = self.adapter.pending_batch, self.adapter.manager
        step = self.adapter.next_step
        if host is None or host.is_warmup or manager is None or step < STORM_FROM:
            return
        for canary in manager.canaries.values():
            rec = canary.records
            n = rec.num_slots
            rec.tokens.copy_(torch.randint(-(2**31), 2**31 - 1, (n,), generator=self.gen, dtype=torch.int32))
            rec.positions.copy_(torch.randint(-(2**31), 2**31 - 1, (n,), generator=self.gen, dtype=torch.int32))
            rec.links.copy_(torch.randint(-(2**62), 2**62, (n,), generator=self.gen, dtype=torch.int64))
        self.expected[step] = [(row, pos) for row, past in enumerate(host.past_lens) for pos in range(past)]
        self.request_ids[step] = host.request_ids
