"""Prometheus counters, read from the manager's host-side totals at scrape time (no per-step cost).

Each manager owns its own ``CollectorRegistry`` (never the process-wide default), so several managers
coexist; an engine exposes it with ``prometheus_client.generate_latest(manager.metrics_registry)`` or
merges it into its own exporter.  Metric names (all counters, so the text format adds ``_total``):

* ``kvcanary_violations_total{group, reason}``: violation rows with that reason bit set
* ``kvcanary_violation_rows_total{group}``: violation rows (one row may carry several reasons)
* ``kvcanary_verified_slots_total{group}``, ``kvcanary_skipped_entries_total{group}``,
  ``kvcanary_stamped_slots_total{group}``
* ``kvcanary_steps_total``: host steps decoded
* ``kvcanary_health_failures_total{check}``: failed ``kernels_ran`` / ``phase`` checks

Values are as of the last decoded step (one step behind the engine until ``flush``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any


@dataclasses.dataclass(frozen=True)
class GroupTotals:
    name: str
    reasons: dict[str, int]
    rows: int
    verified: int
    skipped: int
    stamped: int


@dataclasses.dataclass(frozen=True)
class MetricsView:
    groups: tuple[GroupTotals, ...]
    steps: int
    health_failures: dict[str, int]


class _Collector:
    def __init__(self, source: Callable[[], MetricsView]) -> None:
        self._source = source

    def _families(self, view: MetricsView | None) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        viol = CounterMetricFamily("kvcanary_violations", "Violation rows by reason bit", labels=["group", "reason"])
        rows = CounterMetricFamily("kvcanary_violation_rows", "Violation rows", labels=["group"])
        ver = CounterMetricFamily("kvcanary_verified_slots", "Verify entries checked", labels=["group"])
        skip = CounterMetricFamily("kvcanary_skipped_entries", "Verify entries over capacity", labels=["group"])
        stamp = CounterMetricFamily("kvcanary_stamped_slots", "Records written", labels=["group"])
        steps = CounterMetricFamily("kvcanary_steps", "Host steps decoded")
        health = CounterMetricFamily("kvcanary_health_failures", "Failed health/phase checks", labels=["check"])
        if view is not None:
            for g in view.groups:
                for reason, n in g.reasons.items():
                    viol.add_metric([g.name, reason], n)
                rows.add_metric([g.name], g.rows)
                ver.add_metric([g.name], g.verified)
                skip.add_metric([g.name], g.skipped)
                stamp.add_metric([g.name], g.stamped)
            steps.add_metric([], view.steps)
            for check, n in view.health_failures.items():
                health.add_metric([check], n)
        yield from (viol, rows, ver, skip, stamp, steps, health)

    def describe(self) -> Iterator[Any]:
        return self._families(None)

    def collect(self) -> Iterator[Any]:
        return self._families(self._source())


def make_registry(source: Callable[[], MetricsView]) -> Any | None:
    """A fresh registry holding the canary's collector, or None when prometheus-client is absent."""
    try:
        from prometheus_client import CollectorRegistry
    except ImportError:
        return None
    registry = CollectorRegistry()
    registry.register(_Collector(source))
    return registry
