"""What the scheduler believes about one step, captured on the host when the batch is prepared.

``ContinuousBatchingIOs.prepare_batch_tensors`` advances each request's ``position_offset``, so the
past lengths are read just before it runs.  Ground truth is the request's prompt plus its generated
tokens; in asynchronous batching the token being carried over is not known yet and stays unchecked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

WARMUP_PREFIX = "__warmup_"  # request ids of transformers' warm-up batches (fake requests, never-written KV)


@dataclasses.dataclass(frozen=True)
class HostBatch:
    request_ids: tuple[str, ...]
    past_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    truth: tuple[Sequence[int], ...]  # per request: the token ids the scheduler believes are at 0, 1, ...

    @classmethod
    def from_future_states(cls, future_states: Sequence[Any]) -> HostBatch:
        ids, past, query, truth = [], [], [], []
        for fs in future_states:
            state = fs.state
            ids.append(str(state.request_id))
            past.append(int(state.position_offset))
            query.append(int(fs.query_length))
            truth.append(list(state.initial_tokens) + list(state.generated_tokens))
        return cls(tuple(ids), tuple(past), tuple(query), tuple(truth))

    @property
    def batch_size(self) -> int:
        return len(self.request_ids)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def is_warmup(self) -> bool:
        return any(rid.startswith(WARMUP_PREFIX) for rid in self.request_ids)
