"""The ranks' common verdict: what every rank found at one exchange, the errors raised with it, and how a
rank's reports travel to its peers (pickled; request ids that do not pickle as their ``repr``)."""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable, Mapping, Sequence

from kvcanary.runtime.report import CanaryHealthError, CanaryViolation, StepReport, affected


@dataclasses.dataclass(frozen=True)
class RankVerdict:
    """What the ranks found at one host step, identical on every rank.

    ``reports`` maps the group rank of each rank that found violations to its own report; the
    affected request ids are their union, in rank order.  ``health`` maps each rank whose health
    checks failed to its failed checks (check name -> count).
    """

    step: int  # the host step the findings are about
    reported_at: int  # the host step call (or flush) that acted on them, on every rank
    reports: Mapping[int, StepReport]
    affected_request_ids: tuple[object, ...]
    health: Mapping[int, Mapping[str, int]] = dataclasses.field(default_factory=dict)

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks that found violations."""
        return tuple(sorted(self.reports))

    @property
    def health_ranks(self) -> tuple[int, ...]:
        """The ranks whose health checks failed."""
        return tuple(sorted(self.health))

    def block(self) -> str:
        lines = []
        if self.reports:
            ids = ", ".join(repr(r) for r in self.affected_request_ids) or "unknown"
            lines.append(
                f"kvcanary: violation(s) at step {self.step} found on rank(s) {list(self.ranks)} "
                f"(acted on at step {self.reported_at} on every rank); requests: {ids}"
            )
            lines += [
                f"  rank {r}: {self.reports[r].total} row(s), counts {self.reports[r].counts}" for r in self.ranks
            ]
        if self.health:
            lines.append(self.health_line())
        return "\n".join(lines)

    def health_line(self) -> str:
        failed = "; ".join(
            f"rank {r}: " + ", ".join(f"{check} x{n}" for check, n in self.health[r].items()) for r in self.health_ranks
        )
        return (
            f"kvcanary: health check(s) failed at step {self.step} on rank(s) {list(self.health_ranks)} "
            f"(acted on at step {self.reported_at} on every rank): {failed}"
        )


class RankedViolation(CanaryViolation):
    """Raised on every rank in ``raise`` mode; ``report`` is the lowest finding rank's, ``verdict`` all of them."""

    def __init__(self, verdict: RankVerdict) -> None:
        super().__init__(verdict.reports[verdict.ranks[0]])
        self.args = (verdict.block(),)
        self.verdict = verdict


class RankedHealthError(CanaryHealthError):
    """Raised on every rank in ``raise`` mode when a rank's health check failed (and no rank found violations)."""

    def __init__(self, verdict: RankVerdict) -> None:
        super().__init__(verdict.health_line())
        self.verdict = verdict


DistributedFailRequestCallback = Callable[[list[object], RankVerdict], None]


def merge_reports(reports: Sequence[StepReport]) -> StepReport:
    """One rank's reports of several host steps as one: the first step, the rows and ids of all, counts summed."""
    if len(reports) == 1:
        return reports[0]
    counts: dict[str, int] = {}
    group_counts: dict[str, int] = {}
    for rep in reports:
        for name, n in rep.counts.items():
            counts[name] = counts.get(name, 0) + n
        for name, n in rep.group_counts.items():
            group_counts[name] = group_counts.get(name, 0) + n
    violations = tuple(v for rep in reports for v in rep.violations)
    return StepReport(
        step=reports[0].step,
        reported_at=reports[-1].reported_at,
        violations=violations,
        affected_request_ids=affected(violations),
        counts=counts,
        group_counts=group_counts,
        total=sum(rep.total for rep in reports),
        rows_dropped=sum(rep.rows_dropped for rep in reports),
    )


def verdict_report(verdict: RankVerdict) -> StepReport | None:
    """The verdict's violations as one report, every row naming the rank that found it (None: health only)."""
    if not verdict.reports:
        return None
    ranked = [
        dataclasses.replace(rep, violations=tuple(dataclasses.replace(v, rank=r) for v in rep.violations))
        for r, rep in sorted(verdict.reports.items())
    ]
    merged = merge_reports(ranked)
    return dataclasses.replace(merged, step=verdict.step, reported_at=verdict.reported_at)


def portable_bytes(report: StepReport | None) -> bytes:
    """The report pickled for the peers; request ids that do not pickle travel as their ``repr``."""
    try:
        return pickle.dumps(report)
    except (pickle.PicklingError, TypeError, AttributeError):
        assert report is not None
        violations = tuple(
            dataclasses.replace(v, request_id=None if v.request_id is None else repr(v.request_id))
            for v in report.violations
        )
        portable = dataclasses.replace(report, violations=violations, affected_request_ids=affected(violations))
        return pickle.dumps(portable)
