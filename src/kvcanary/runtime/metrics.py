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

Serving ``/metrics`` over HTTP (one line; ``canary`` is a ``CanaryManager`` or an engine adapter, both
have ``metrics_registry``)::

    server = kvcanary.runtime.metrics.serve_metrics(canary, port=9400)   # server.close() to stop

The adapter's manager is rebuilt when the engine builds a new KV cache, and its counters start again
from zero then (Prometheus treats that as a counter reset); ``serve_metrics`` always serves the
current one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

METRICS_HINT = "pip install 'prometheus-client>=0.20' (or the metrics extra: pip install -e '.[metrics]')"


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


class _CurrentRegistry:
    """Collects from whatever registry ``source()`` returns at scrape time (nothing while it is None)."""

    def __init__(self, source: Callable[[], Any]) -> None:
        self._source = source

    def describe(self) -> Iterable[Any]:
        return ()  # no call into the source at registration: it may not exist yet

    def collect(self) -> Iterable[Any]:
        registry = self._source()
        return () if registry is None else registry.collect()


@dataclasses.dataclass
class MetricsServer:
    """A running ``/metrics`` endpoint (prometheus_client's HTTP server on a daemon thread)."""

    host: str
    port: int
    _server: Any
    _thread: Any

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def _registry_source(source: Any) -> Callable[[], Any]:
    if hasattr(source, "metrics_registry"):  # a CanaryManager or an engine adapter: read it at each scrape
        return lambda: source.metrics_registry
    if hasattr(source, "collect"):  # a registry
        return lambda: source
    if callable(source):
        return source  # type: ignore[no-any-return]
    raise TypeError(
        "serve_metrics takes a CanaryManager, an adapter, a registry or a callable returning one, "
        f"got {type(source).__name__}"
    )


def serve_metrics(source: Any, port: int = 9400, host: str = "127.0.0.1") -> MetricsServer:
    """Serve the canary's counters at ``http://host:port/metrics`` (``port=0``: any free port).

    Raises ImportError (with the install hint) when prometheus-client is absent.
    """
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in 0..65535, got {port!r}")
    current = _registry_source(source)
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError as exc:
        raise ImportError(f"serving kvcanary metrics needs prometheus-client ({METRICS_HINT}): {exc}") from None
    registry = CollectorRegistry()
    registry.register(_CurrentRegistry(current))
    server, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(host=host, port=int(server.server_port), _server=server, _thread=thread)
