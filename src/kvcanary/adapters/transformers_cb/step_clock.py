"""The engine's step time: what ``kvcanary demo --baseline`` compares with and without the canary.

A timed demo run's wall time holds more than steps: the engine builds its cache and batch processor, starts and
joins its loop thread, runs a full garbage collection at the end of each ``generate_batch`` (about 0.1 s a
collection with a model and torch loaded) and waits between waves.  That part is a quarter of a GPU demo run, none
of it the canary's, and it moves from run to run by more than the canary costs.  The clock sums the engine's
generation-loop bodies that ran a step (the manager's batch counter moved): scheduling, offload and restore,
the inputs' preparation, the forward with the canary's tap, the batch update, so every per-step cost of the canary
(its set-up in the first step, mirroring the engine's block moves) is inside, and the loop's waits for requests
are not.

It also sums the CPU time the loop thread spent in those bodies (``cpu_seconds``): the time the thread itself ran,
which the canary's host work adds to (it runs on that thread, and the host's waits for the device spin there too),
and which leaves out any time the thread waited or was descheduled.  On the H100 hosts measured it equalled the wall
time to 0.1 %: there the runs' spread (one of a few speeds from run to run) is the thread running slower, not
waiting.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvcanary.adapters.patching import PatchSet


class StepClock:
    """Seconds and count of the engine's steps while entered (every manager of the process; the bodies run on the
    manager's loop thread, read the totals after ``generate_batch`` returned).  ``available`` is False where this
    transformers has no generation-loop body to time; the totals then stay 0.  ``keep``: also keep each step's
    seconds, in order (``durations``: where the time went within a run, for the GPU probes)."""

    def __init__(self, keep: bool = False) -> None:
        self.seconds = 0.0
        self.cpu_seconds = 0.0  # the loop thread's CPU time in the same bodies
        self.steps = 0
        self.durations: list[float] | None = [] if keep else None
        self.available = False
        self._patches = PatchSet(exclusive=False)

    def __enter__(self) -> StepClock:
        from transformers.generation.continuous_batching import continuous_api

        manager = getattr(continuous_api, "ContinuousBatchingManager", None)
        if manager is not None and callable(getattr(manager, "_generation_loop_body", None)):
            self._patches.wrap(manager, "_generation_loop_body", self._timed)
            self.available = True
        return self

    def __exit__(self, *exc: object) -> None:
        self._patches.restore()

    def _timed(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def body(manager: Any, *args: Any, **kwargs: Any) -> Any:
            before = getattr(manager, "current_batch", None)
            cpu = time.thread_time()
            start = time.perf_counter()
            out = original(manager, *args, **kwargs)
            if getattr(manager, "current_batch", None) != before:  # a step ran (not a wait for requests)
                took = time.perf_counter() - start
                self.cpu_seconds += time.thread_time() - cpu
                self.seconds += took
                self.steps += 1
                if self.durations is not None:
                    self.durations.append(took)
            return out

        return body
