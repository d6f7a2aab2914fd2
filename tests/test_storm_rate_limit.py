"""The log rate limiter: what it lets through, what it counts, and that nothing held back goes unsaid.

Unit level (a fake clock) and through the manager: violation reports and health failures each have a
limiter; the next logged message carries the count of what was held back, and ``flush`` (end of a
run) says what is still held.  The storm through the real engine is tests/test_storm.py.
"""

from __future__ import annotations

import logging
import re

import pytest

from kvcanary import Mode
from kvcanary.runtime.checks import RateLimiter
from runtime_helpers import Workload, alias_first_slot, emulate_capture, make_manager, replay, run_step


def test_the_limiter_lets_one_event_through_per_interval_and_counts_the_rest() -> None:
    now = [0.0]
    limiter = RateLimiter(2.0, clock=lambda: now[0])
    passed = []
    for k in range(20):
        now[0] = 0.1 * k  # 10 events a second for 2 s, at most 2 a second allowed
        passed.append(limiter.allow())
    assert [k for k, ok in enumerate(passed) if ok] == [0, 5, 10, 15]
    assert limiter.suppressed == 16
    assert limiter.suppressed_note("report(s)") == "(16 earlier report(s) suppressed by the rate limit)"
    assert limiter.suppressed == 0 and limiter.suppressed_note("report(s)") == ""


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records]


def _held_back(messages: list[str], what: str) -> int:
    return sum(int(n) for m in messages for n in re.findall(rf"\((\d+) earlier {what} suppressed by the rate", m))


def test_every_violation_report_is_logged_or_counted_as_suppressed(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    mgr = make_manager(Mode.LOG, health_every=0, log_rate_limit_per_s=1.0)
    mgr._decoder._log_limiter._clock = lambda: now[0]  # the manager's own limiter, on a fake clock
    wl = Workload()
    reports = 0
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        run_step(mgr, wl.batch([(1, 4), (2, 4)]), ["a", "b"])
        alias_first_slot(wl, victim=2, owner=1)
        for k in range(12):
            now[0] = 0.25 * k  # 4 reports a second, 1 a second logged
            reports += run_step(mgr, wl.batch([(1, 1), (2, 1)]), ["a", "b"]) is not None
        reports += mgr.flush() is not None
    messages = _messages(caplog)
    headers = [m for m in messages if re.match(r"kvcanary: \d+ violation\(s\) at step", m)]
    assert reports == 12 and len(headers) == 3  # at 0, 1 and 2 s
    assert _held_back(messages, r"(?:violation )?report\(s\)") == reports - len(headers)
    assert any(m.startswith("kvcanary: (") and "violation report(s)" in m for m in messages), "flush said nothing"
    assert mgr._decoder._log_limiter.suppressed == 0


def test_health_failures_are_rate_limited_with_a_count_too(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    mgr = make_manager(Mode.LOG, health_every=0, log_rate_limit_per_s=1.0)
    mgr._decoder._health_limiter._clock = lambda: now[0]
    wl = Workload()
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        run_step(mgr, wl.batch([(1, 4)]), ["a"])
        emulate_capture(mgr)
        for k in range(10):
            now[0] = 0.3 * k
            replay(mgr, wl.batch([(1, 1)]), before=False, after=False)  # a graph without the canary's work
            mgr.host_step(["a"])
        mgr.flush()
    messages = _messages(caplog)
    logged = [m for m in messages if m.startswith("kvcanary health check failed")]
    failures = mgr.stats()["health_failures"]
    assert failures == 10 and len(logged) == 3  # at 0.3, 1.5 and 2.7 s (step 0's decode is clean)
    assert len(logged) + _held_back(messages, r"health failure\(s\)") == failures
