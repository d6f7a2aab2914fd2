"""The manager's host side after the copy landed: decode a step, run the health checks, act by mode.

:meth:`StepDecoder.decode` turns one step's host copy into a :class:`StepReport` (only when a group's
violation total moved) and a list of failed checks; counts, logs and events of failed checks happen
there.  :meth:`StepDecoder.act` then logs, raises or fails requests per the mode -- after the manager
staged the next copy, so a raise loses nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from kvcanary.config import CanaryConfig, Mode
from kvcanary.runtime.buffers import PHASE_AFTER, PHASE_BEFORE, Layout
from kvcanary.runtime.checks import NEVER, KernelHealth, PhaseCheck, RateLimiter
from kvcanary.runtime.culprit import annotate
from kvcanary.runtime.events import EventLog
from kvcanary.runtime.metrics import GroupTotals, MetricsView
from kvcanary.runtime.pump import HostBuffer
from kvcanary.runtime.report import (
    CanaryHealthError,
    CanaryViolation,
    FailRequestCallback,
    StepReport,
    Violation,
    affected,
    decode_row,
)
from kvcanary.schema import NUM_COUNTERS, REASON_NAMES, Counter

logger = logging.getLogger("kvcanary")

Problem = tuple[str, str | None, str]  # a failed check: (check, group or None, detail)
Decoded = tuple[StepReport | None, list[Problem]]
LOCATED_PER_REPORT = 4  # digest mismatches per report whose layer is looked for (each re-reads one slot)

EMPTY_STATS = {
    "steps": 0,
    "forwards": 0,
    "verified_slots": 0,
    "violations": 0,
    "skipped_entries": 0,
    "stamped": 0,
    "health_failures": 0,
}


class StepDecoder:
    """Totals as of the last decoded step, the checks' state and the mode's actions, for one manager."""

    def __init__(
        self,
        group_names: Sequence[str],
        layout: Layout,
        config: CanaryConfig,
        on_fail_request: FailRequestCallback | None,
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.on_fail_request = on_fail_request
        self.group_names = tuple(group_names)
        self.steps_decoded = 0
        self.health_failures = {"kernels_ran": 0, "phase": 0}
        self.events: EventLog | None = None
        if config.events_path is not None:
            self.events = EventLog(config.events_path, config.events_max_bytes)
        n = len(self.group_names)
        # Totals as of the last decoded step: a view of that step's host buffer (see pump.py).
        self.seen: npt.NDArray[np.int64] = np.zeros((n, NUM_COUNTERS), dtype=np.int64)
        # What the per-step fast path reads: the two phase marks and each group's violation total.
        self._watch_before = layout.phase_offset + PHASE_BEFORE
        self._watch_after = layout.phase_offset + PHASE_AFTER
        # Each group's violation total, read in one call (a value for one group, a tuple for several).
        self._watched = operator.itemgetter(
            *[layout.totals_offset + g * NUM_COUNTERS + Counter.VIOLATIONS for g in range(n)]
        )
        self._seen_rows: object = self._watched([0] * layout.outbox_size)
        self._next_stats = config.stats_every - 1 if config.stats_every else NEVER  # the next step with a stats line
        self.phase = PhaseCheck()
        self._health = KernelHealth(n, config.health_every, config.health_warmup)
        self._log_limiter = RateLimiter(config.log_rate_limit_per_s, clock)
        self._health_limiter = RateLimiter(config.log_rate_limit_per_s, clock)
        self._warned_skip = False
        self.locate: Callable[[Violation], str] | None = None  # names a digest mismatch's layer (manager)
        self._locate_limiter = RateLimiter(config.log_rate_limit_per_s, clock)  # a storm pays it a few times a second

    def decode(self, buf: HostBuffer, reported_at: int) -> Decoded | None:
        """Decode one step's host copy and run the checks; None when there is nothing to act on."""
        if not buf.known_landed:
            buf.wait()
        words, step = buf.words, buf.step
        self.steps_decoded += 1
        problems: list[Problem] = []
        # The clean step's path makes as few calls as it can (it runs with the CPU caches cold): the phase check's
        # clean case (both marks advanced, by the same amount; PhaseCheck.advance is the rule) is tested inline.
        before, after, phase = words[self._watch_before], words[self._watch_after], self.phase
        if before > phase.before and after - before == phase.after - phase.before:
            phase.before, phase.after = before, after
        else:
            phase_problem = phase.advance(before, after)
            if phase_problem is not None:
                problems.append(("phase", None, phase_problem))
        rows = self._watched(words)
        report = self._build_report(buf, reported_at) if rows != self._seen_rows else None
        self._seen_rows = rows
        previous, self.seen = self.seen, buf.totals  # the totals stay readable until the next decode
        if step >= self._health.next_due and self._health.due(step):
            problems.extend(self._check_kernels(previous))
        for check, group, detail in problems:
            self._record_health_failure(step, check, group, detail)
        if step >= self._next_stats:
            self._next_stats += self.config.stats_every
            self._stats_line(step)
        if report is None and not problems:
            return None
        return report, problems

    def _build_report(self, buf: HostBuffer, reported_at: int) -> StepReport:
        delta = buf.totals - self.seen
        violations: list[Violation] = []
        counts: dict[str, int] = {}
        group_counts: dict[str, int] = {}
        total = 0
        for g, (name, log) in enumerate(zip(self.group_names, buf.logs, strict=True)):
            rows = int(delta[g, Counter.VIOLATIONS])
            if rows <= 0:
                continue
            total += rows
            group_counts[name] = rows
            for r, reason in enumerate(REASON_NAMES):
                if delta[g, r]:
                    counts[reason] = counts.get(reason, 0) + int(delta[g, r])
            violations.extend(annotate([decode_row(row, name, buf.request_ids) for row in log.rows().tolist()]))
        violations = self._locate_layers(violations)
        return StepReport(
            step=buf.step,
            reported_at=reported_at,
            violations=tuple(violations),
            affected_request_ids=affected(violations),
            counts=counts,
            group_counts=group_counts,
            total=total,
            rows_dropped=max(total - len(violations), 0),
        )

    def _locate_layers(self, violations: list[Violation]) -> list[Violation]:
        """The first few digest mismatches get a note naming the layer whose bytes differ (``locate``, set by
        the manager when digests are attached; it reads the slots' bytes, so only rows of a report pay it, and
        at most ``log_rate_limit_per_s`` reports a second)."""
        if self.locate is None or not any("digest_mismatch" in v.reasons for v in violations):
            return violations
        if not self._locate_limiter.allow():
            return violations
        out, left = [], LOCATED_PER_REPORT
        for v in violations:
            if left and "digest_mismatch" in v.reasons and v.slot >= 0:
                left -= 1
                note = self.locate(v)
                v = dataclasses.replace(v, note=note) if note else v
            out.append(v)
        return out

    def act(self, report: StepReport | None, problems: list[Problem]) -> StepReport | None:
        """Act on a decoded step by mode; in raise mode a violation wins over a failed check."""
        mode = self.config.mode
        if report is not None:
            if self.events is not None:
                self.events.report(report)
            if mode is Mode.RAISE:
                raise CanaryViolation(report)
            if self._log_limiter.allow():
                for line in report.lines():
                    logger.warning(line)
                note = self._log_limiter.suppressed_note("report(s)")
                logger.warning(report.summary() + (f"\n  {note}" if note else ""))  # rows logged once each, above
            if mode is Mode.FAIL_REQUEST and self.on_fail_request is not None:
                self.on_fail_request(list(report.affected_request_ids), report)
        if problems and mode is Mode.RAISE:
            raise CanaryHealthError("; ".join(f"{check}: {detail}" for check, _, detail in problems))
        return report

    def log_suppressed(self) -> None:
        """End of a run: say what the rate limits held back since their last logged message."""
        for limiter, what in ((self._log_limiter, "violation report(s)"), (self._health_limiter, "health failure(s)")):
            note = limiter.suppressed_note(what)
            if note:
                logger.warning("kvcanary: %s; stats() counts every one (so does the event log, when set)", note)

    def _check_kernels(self, previous: npt.NDArray[np.int64]) -> list[Problem]:
        calls = [int(c) for c in self.seen[:, Counter.CALLS]]
        problems: list[Problem] = []
        for g in self._health.stale_groups(calls):
            name = self.group_names[g]
            detail = (
                f"canary kernels did not run for group {name!r} since the previous health check "
                f"(CALLS counter stuck at {calls[g]})"
            )
            problems.append(("kernels_ran", name, detail))
        skipped = self.seen[:, Counter.SKIPPED] - previous[:, Counter.SKIPPED]
        if skipped.any() and not self._warned_skip:
            self._warned_skip = True
            logger.warning(
                "kvcanary: verification was partial: %d verify entries skipped over capacity in the last step "
                "(reported once); raise Capacities.verify_entries to verify everything",
                int(skipped.sum()),
            )
        return problems

    def _record_health_failure(self, step: int, check: str, group: str | None, detail: str) -> None:
        """Count, log (rate-limited, not in raise mode) and record one failed check."""
        self.health_failures[check] += 1
        if self.events is not None:
            self.events.health(step, check, group, detail)
        if self.config.mode is not Mode.RAISE and self._health_limiter.allow():
            note = self._health_limiter.suppressed_note("health failure(s)")
            logger.error("kvcanary health check failed at step %d (%s): %s%s", step, check, detail, note and f" {note}")

    def stats(self) -> dict[str, int]:
        """Cumulative counts as of the last decoded step."""
        seen = self.seen
        return {
            "steps": self.steps_decoded,
            "forwards": self.phase.before,
            "verified_slots": int(seen[:, Counter.VERIFIED].sum()),
            "violations": int(seen[:, Counter.VIOLATIONS].sum()),
            "skipped_entries": int(seen[:, Counter.SKIPPED].sum()),
            "stamped": int(seen[:, Counter.STAMPED].sum()),
            "health_failures": sum(self.health_failures.values()),
        }

    def _stats_line(self, step: int) -> None:
        s = self.stats()
        # WARNING, not INFO: the line exists only when the user asked for it (stats_every > 0), and Python's
        # default logging shows WARNING and above.
        logger.warning(
            "kvcanary stats: step=%d forwards=%d verified_slots=%d stamped=%d violations=%d skipped_entries=%d "
            "health_failures=%d",
            step,
            s["forwards"],
            s["verified_slots"],
            s["stamped"],
            s["violations"],
            s["skipped_entries"],
            s["health_failures"],
        )
        if self.events is not None:
            self.events.stats(step, {k: v for k, v in s.items() if k != "steps"})

    def metrics_view(self) -> MetricsView:
        seen = self.seen.copy()
        groups = tuple(
            GroupTotals(
                name=name,
                reasons={r: int(seen[i, j]) for j, r in enumerate(REASON_NAMES)},
                rows=int(seen[i, Counter.VIOLATIONS]),
                verified=int(seen[i, Counter.VERIFIED]),
                skipped=int(seen[i, Counter.SKIPPED]),
                stamped=int(seen[i, Counter.STAMPED]),
            )
            for i, name in enumerate(self.group_names)
        )
        return MetricsView(groups=groups, steps=self.steps_decoded, health_failures=dict(self.health_failures))
