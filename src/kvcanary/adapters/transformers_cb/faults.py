"""Deliberate index corruption, injected into the tensors a forward hands to attention (demo and tests).

A :class:`FaultInjector` is the adapter's input probe (called just before the engine runs a step, so it
works for eager forwards, compiled ones and CUDA-graph replays alike): once, at the first eligible step
at or after ``after_step``, it edits the forward's kwargs in place -- the static index buffers the
attention layers then really use -- and records what it did.  Faults:

* ``read-swap``: swap the oldest and the newest past entries of one request's ``read_index`` segment
  (attention reads its context in the wrong order).  Caught the same step.
* ``read-foreign``: point one past ``read_index`` entry of a request at another request's slot
  (attention reads another request's KV).  Caught the same step.
* ``write-misdirect``: send one token's ``write_index`` entry to the slot of the request's previous
  token (its KV overwrites live context and its own slot stays stale).  Caught at the next read.
* ``position-skew``: shift one ``position_ids`` entry by one (the token is rotated as if it sat one
  position later).  Caught the same step.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvcanary.adapters.transformers_cb.adapter import TransformersCBAdapter

FAULTS: tuple[str, ...] = ("read-swap", "read-foreign", "write-misdirect", "position-skew")


@dataclasses.dataclass(frozen=True)
class InjectedFault:
    name: str
    group: str
    step: int  # the canary step of the corrupted forward
    request_id: str
    detail: str


class FaultInjector:
    def __init__(self, adapter: TransformersCBAdapter, name: str, *, group: str | None = None, after_step: int = 8):
        if name not in FAULTS:
            raise ValueError(f"unknown fault {name!r}; choose one of: {', '.join(FAULTS)}")
        if group not in (None, "full_attention", "sliding_attention"):
            raise ValueError(f"group must be None, 'full_attention' or 'sliding_attention', got {group!r}")
        if after_step < 0:
            raise ValueError(f"after_step must be >= 0, got {after_step}")
        self.adapter = adapter
        self.name = name
        self.group = group
        self.after_step = after_step
        self.injected: InjectedFault | None = None

    def attach(self) -> FaultInjector:
        self.adapter.set_input_probe(self._probe)
        return self

    def detach(self) -> None:
        self.adapter.set_input_probe(None)

    def _probe(self, kwargs: dict[str, Any]) -> None:
        if self.injected is not None or kwargs.get("cache") is None or kwargs.get("block_table") is not None:
            return
        host = self.adapter.pending_batch
        step = self.adapter.next_step
        if host is None or host.is_warmup or step < self.after_step:
            return
        names = list(kwargs["cache"].cache_allocators)
        group = self.group or ("full_attention" if "full_attention" in names else names[0])
        if group not in names:
            raise ValueError(f"the model has no {group!r} group (groups: {names})")
        gi = names.index(group)
        read = kwargs["read_index"][gi]
        cu_k = kwargs["cu_seq_lens_k"][group].tolist()
        cu_q = kwargs["cu_seq_lens_q"].tolist()
        past = [cu_k[r + 1] - cu_k[r] - q for r, q in enumerate(host.query_lens)]  # past entries read per row
        done = self._inject(kwargs, gi, group, read, cu_k, cu_q, past, host.request_ids)
        if done is not None:
            row, detail = done
            self.injected = InjectedFault(self.name, group, step, host.request_ids[row], detail)

    def _inject(
        self,
        kwargs: dict[str, Any],
        gi: int,
        group: str,
        read: torch.Tensor,
        cu_k: list[int],
        cu_q: list[int],
        past: list[int],
        request_ids: tuple[str, ...],
    ) -> tuple[int, str] | None:
        rows = range(len(past))
        if self.name == "read-swap":
            for r in rows:
                if past[r] >= 2:
                    i, j = cu_k[r], cu_k[r] + past[r] - 1
                    read[[i, j]] = read[[j, i]].clone()
                    return r, f"read_index[{group}] entries {i} and {j} (oldest and newest context token) swapped"
        elif self.name == "read-foreign":
            donors = [r for r in rows if past[r] >= 1]
            for r in donors:
                for d in donors:
                    if d != r:
                        i, src = cu_k[r] + past[r] - 1, cu_k[d]
                        read[i] = read[src].clone()
                        return r, f"read_index[{group}] entry {i} redirected to a slot of request {request_ids[d]!r}"
        elif self.name == "write-misdirect":
            write = kwargs["write_index"][gi]
            for r in rows:
                if past[r] >= 1:
                    t, victim = cu_q[r], cu_k[r] + past[r] - 1
                    write[t] = read[victim].clone()
                    return r, f"write_index[{group}] entry {t} redirected onto the slot of the previous token"
        else:  # position-skew
            positions = kwargs["position_ids"].view(-1)
            for r in rows:
                if past[r] >= 1:
                    t = cu_q[r]
                    positions[t] += 1
                    return r, f"position_ids entry {t} shifted by +1"
        return None
