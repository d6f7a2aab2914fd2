"""What the engine did, as the canary saw it: counters a test can assert on (``VllmCanary.features()``)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

FEATURES = (
    "steps",  # engine steps whose forward the canary checked
    "rows",  # batch rows checked (a request in a step)
    "prefill_rows",  # rows writing more than one token
    "chunked_prefill_rows",  # prefill rows that end before the prompt does (a chunk)
    "decode_rows",  # rows writing one token
    "prefix_hit_requests",  # requests admitted with cached tokens (prefix-cache hits)
    "prefix_hit_tokens",
    "same_step_readers",  # rows verified in a later pass: they read blocks written in the same step
    "resumed_requests",  # requests resumed after preemption
    "preempted_requests",
    "finished_requests",  # finished or aborted
    "zeroed_blocks",  # new blocks vLLM zeroed (records cleared)
    "reused_blocks",  # of those, blocks that held written records (freed or evicted, then reallocated)
    "block_copies",  # copy-on-write block copies (records copied)
    "draft_tokens",  # speculative tokens scheduled for verification
    "failed_requests",  # requests failed through vLLM's abort path (fail-request mode)
    "canary_errors",  # canary-side exceptions swallowed in log / fail-request mode
)


class Features:
    def __init__(self) -> None:
        self.counts = dict.fromkeys(FEATURES, 0)
        self.host_seconds = 0.0  # canary host time inside the engine step
        self.core_seconds = 0.0  # of which in the canary core (CanaryManager calls)
        self.timed_steps = 0

    def add(self, name: str, n: int = 1) -> None:
        self.counts[name] += n

    def scheduler_output(self, so: Any) -> None:
        for req in so.scheduled_new_reqs:
            if req.num_computed_tokens > 0:
                self.counts["prefix_hit_requests"] += 1
                self.counts["prefix_hit_tokens"] += int(req.num_computed_tokens)
        self.counts["resumed_requests"] += len(so.scheduled_cached_reqs.resumed_req_ids)
        self.counts["preempted_requests"] += len(so.preempted_req_ids or ())
        self.counts["finished_requests"] += len(so.finished_req_ids)
        self.counts["draft_tokens"] += sum(len(v) for v in so.scheduled_spec_decode_tokens.values())

    def rows(self, prefix: torch.Tensor, extend: torch.Tensor, prompt_lens: list[int]) -> None:
        ext = extend.tolist()
        end = (prefix + extend).tolist()
        self.counts["rows"] += len(ext)
        for e, stop, plen in zip(ext, end, prompt_lens, strict=True):
            if e > 1:
                self.counts["prefill_rows"] += 1
                if stop < plen:
                    self.counts["chunked_prefill_rows"] += 1
            else:
                self.counts["decode_rows"] += 1

    def timed(self, start: float) -> None:
        self.host_seconds += time.perf_counter() - start

    def snapshot(self) -> Mapping[str, int]:
        return dict(self.counts)
