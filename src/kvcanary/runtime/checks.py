"""Host-side checks that the canary's device work actually ran, plus the log rate limiter.

* Phase check (every decoded step): the device counts ``before`` and ``after`` marks.  Between two
  host steps both must advance, by the same amount.  A replayed CUDA graph captured without the
  canary's work leaves them unchanged; one with only half of it leaves them unequal.
* Kernel health check (every ``health_every`` steps): each group's CALLS counter (bumped by every
  plan/verify/stamp that ran) must have advanced since the previous check.
"""

from __future__ import annotations

import time
from collections.abc import Callable

NEVER = 1 << 62  # a step no run reaches


class PhaseCheck:
    def __init__(self) -> None:
        self.before = 0
        self.after = 0

    def advance(self, before: int, after: int) -> str | None:
        """Record the cumulative marks of one host step; a description of the problem, or None."""
        db, da = before - self.before, after - self.after
        self.before, self.after = before, after
        if db >= 1 and da == db:
            return None
        if db == 0 and da == 0:
            return (
                "no canary device work ran in this step: a replayed CUDA graph was captured without "
                "before_forward/after_forward, or the forward bypassed the canary hooks"
            )
        return (
            f"canary phase marks out of step: before_forward ran {db} time(s), after_forward {da} time(s) "
            "since the previous host step (a CUDA graph holds only part of the canary's work?)"
        )


class KernelHealth:
    """Tracks each group's CALLS counter between checks."""

    def __init__(self, num_groups: int, every: int, warmup: int) -> None:
        self.every = every
        self.warmup = warmup
        self._calls = [0] * num_groups
        self.next_due = warmup if every > 0 else NEVER  # no step before it is due: one compare a step

    def due(self, step: int) -> bool:
        """Whether ``step`` is checked; steps come in increasing order (:attr:`next_due` moves past it)."""
        if self.every <= 0 or step < self.warmup:
            return False
        past_due = (step - self.warmup) % self.every
        self.next_due = step - past_due + self.every
        return past_due == 0

    def stale_groups(self, calls: list[int]) -> list[int]:
        """Indices of groups whose counter did not advance since the previous check."""
        stale = [g for g, (now, then) in enumerate(zip(calls, self._calls, strict=True)) if now <= then]
        self._calls = list(calls)
        return stale


class RateLimiter:
    """At most ``per_s`` events a second; counts what it suppressed."""

    def __init__(self, per_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval = 1.0 / per_s
        self._clock = clock
        self._next = float("-inf")
        self.suppressed = 0

    def allow(self) -> bool:
        now = self._clock()
        if now >= self._next:
            self._next = now + self._interval
            return True
        self.suppressed += 1
        return False

    def take_suppressed(self) -> int:
        n, self.suppressed = self.suppressed, 0
        return n

    def suppressed_note(self, what: str) -> str:
        """``"(N earlier <what> suppressed by the rate limit)"`` to append to the next logged message, or ``""``."""
        n = self.take_suppressed()
        return f"({n} earlier {what} suppressed by the rate limit)" if n else ""
