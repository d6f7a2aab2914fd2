"""The multi-request workload the sglang tests and self-test drive through sglang's own scheduler.

Seeded, so a control run and a faulted run with the same seed take the same path up to the injection.
Its shape makes sglang do every scheduling move the canary must follow: a shared system prompt (radix
prefix hits across requests), prompts longer than the prefill chunk (chunked prefill), arrivals while
others decode (mixed batches), decode lengths that overrun the small pool (``retract_decode``, then the
retracted requests' resume), an abort of a running request, and slots freed by finished requests and
handed to later ones.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any

from kvcanary.adapters.sglang.selftest.scheduler_loop import BatchHook, SchedulerLoop
from kvcanary.adapters.sglang.selftest.tiny_model import VOCAB

SYSTEM_PROMPT = 20
StepHook = Callable[[SchedulerLoop, int], None]  # after each loop iteration: (loop, iteration)


@dataclasses.dataclass(frozen=True)
class WorkloadRequest:
    rid: str
    input_ids: tuple[int, ...]
    max_new_tokens: int
    arrive_at: int  # loop iteration at which the request is submitted
    abort_after: int | None = None  # abort it this many iterations after it first runs (None: never)


def standard_workload(seed: int, *, requests: int = 7) -> list[WorkloadRequest]:
    rng = random.Random(seed)
    system = [rng.randrange(3, VOCAB) for _ in range(SYSTEM_PROMPT)]
    out = []
    for i in range(requests):
        shared = system if i % 3 != 2 else system[: rng.randrange(4, SYSTEM_PROMPT)]  # partial prefix hits too
        tail = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 14))]
        out.append(
            WorkloadRequest(
                rid=f"req{i}",
                input_ids=tuple(shared + tail),
                max_new_tokens=rng.randrange(16, 30),
                arrive_at=0 if i < 3 else rng.randrange(2, 12),
                abort_after=6 if i == 4 else None,
            )
        )
    return out


def run_workload(
    loop: SchedulerLoop,
    requests: list[WorkloadRequest],
    *,
    before_forward: BatchHook | None = None,
    after_step: StepHook | None = None,
    stop: Callable[[], bool] | None = None,
    max_steps: int = 300,
) -> int:
    """Submit, step and abort as the requests say until the loop is idle (or ``stop()`` says so after an
    iteration); returns the forwards run.  ``loop.pending_arrivals`` counts the requests not yet submitted."""
    pending = sorted(requests, key=lambda r: r.arrive_at)
    first_run: dict[str, int] = {}
    aborts = {r.rid: r.abort_after for r in requests if r.abort_after is not None}
    forwards = 0
    for it in range(max_steps):
        while pending and pending[0].arrive_at <= it:
            r = pending.pop(0)
            loop.submit(r.rid, list(r.input_ids), r.max_new_tokens)
        loop.pending_arrivals = len(pending)
        batch = loop.step(before_forward)
        if batch is not None:
            forwards += 1
            _abort_due(loop, batch, it, first_run, aborts)
        if after_step is not None:
            after_step(loop, it)
        if (batch is None and not pending and loop.idle) or (stop is not None and stop()):
            break
    loop.pending_arrivals = 0
    return forwards


def _abort_due(loop: SchedulerLoop, batch: Any, it: int, first_run: dict[str, int], aborts: dict[str, int]) -> None:
    for req in batch.reqs:
        first_run.setdefault(req.rid, it)
    for rid, after in list(aborts.items()):
        if rid in first_run and it - first_run[rid] >= after:
            loop.abort(rid)
            del aborts[rid]
