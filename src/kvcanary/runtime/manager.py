"""The per-KV-pool canary manager: the one object an engine adapter talks to.

Per engine step::

    mgr.before_forward({"full": batch, ...})   # plan, verify, stamp every group (graph-capturable)
    model.forward(...)
    mgr.after_forward()                        # phase mark, snapshot + clear of the log (graph-capturable)
    mgr.host_step(request_ids)                 # outside any graph: lagged pump, reporting

The first two may be captured once in a CUDA graph and replayed (inputs refilled in place); the
manager then sees only ``host_step`` calls and relies on the device phase marks to notice a replay
that lacks its work.  A violation of host step k is decoded and acted upon by host step k + 1 (or
:meth:`CanaryManager.flush`).  One before/after pair per host step gives exact attribution; several
are allowed (warm-up forwards, for instance): counts stay exact, rows of all but the last are dropped
and reported as such.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import numpy.typing as npt
import torch

from kvcanary.batch import StepBatch
from kvcanary.canary import GroupCanary, resolve_device
from kvcanary.config import CanaryConfig, Mode
from kvcanary.layout import CanaryGroup
from kvcanary.ops import Backend
from kvcanary.runtime.buffers import PHASE_AFTER, PHASE_BEFORE, Layout, StepWork
from kvcanary.runtime.checks import KernelHealth, PhaseCheck, RateLimiter
from kvcanary.runtime.culprit import annotate
from kvcanary.runtime.events import EventLog
from kvcanary.runtime.metrics import GroupTotals, MetricsView, make_registry
from kvcanary.runtime.pump import HostBuffer, LaggedPump
from kvcanary.runtime.report import (
    CanaryHealthError,
    CanaryViolation,
    StepReport,
    Violation,
    affected,
    decode_row,
)
from kvcanary.runtime.validation import validate_step
from kvcanary.schema import NUM_COUNTERS, REASON_NAMES, Counter
from kvcanary.workspace import Capacities

logger = logging.getLogger("kvcanary")

FailRequestCallback = Callable[[list[object], StepReport], None]
Problem = tuple[str, str | None, str]  # a failed check: (check, group or None, detail)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _uses_kernels(backend: Backend, device: torch.device) -> bool:
    # Mirrors GroupCanary's dispatch: the reference does host reads and cannot be captured.
    return backend is Backend.TRITON or (backend is Backend.AUTO and device.type == "cuda")


class CanaryManager:
    """Canary state and reporting for one KV pool (one or more groups).

    Everything is allocated here, once: each group's records and plan workspace, the live log, the
    outbox and two host buffers (pinned on CUDA).  In ``off`` mode nothing is allocated, every
    method is a no-op and :attr:`canaries` is empty.
    """

    def __init__(
        self,
        groups: Sequence[CanaryGroup],
        caps: Capacities | Mapping[str, Capacities],
        config: CanaryConfig,
        device: torch.device | str = "cpu",
        backend: Backend = Backend.AUTO,
        on_fail_request: FailRequestCallback | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(config, CanaryConfig):
            raise TypeError(f"config must be a kvcanary.CanaryConfig, got {type(config).__name__}")
        if not isinstance(backend, Backend):
            raise TypeError(f"backend must be a kvcanary.Backend, got {backend!r}")
        groups = list(groups)
        if not groups:
            raise ValueError("groups is empty: a manager needs at least one CanaryGroup")
        for g in groups:
            if not isinstance(g, CanaryGroup):
                raise TypeError(f"groups must hold CanaryGroup objects, got {type(g).__name__}")
        names = [g.name for g in groups]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"group names must be unique, repeated: {dup}")
        caps_by_name = self._caps_by_name(caps, names)
        if config.mode is Mode.FAIL_REQUEST and on_fail_request is None:
            raise ValueError("mode fail-request needs an on_fail_request callback")
        if on_fail_request is not None and not callable(on_fail_request):
            raise TypeError("on_fail_request must be callable")

        self.config = config
        self.device = resolve_device(device)
        self.backend = backend
        self.groups = tuple(groups)
        self.on_fail_request = on_fail_request
        self.canaries: dict[str, GroupCanary] = {}
        self.metrics_registry: object | None = None
        self._enabled = config.mode is not Mode.OFF
        self._step = 0  # index of the next host step
        self._open = False  # before_forward ran, after_forward pending
        self._open_capturing = False
        self._eager_forwards = 0  # before/after pairs run eagerly since the last host step
        self._graph_captured = False
        self._steps_decoded = 0
        self._health_failures = {"kernels_ran": 0, "phase": 0}
        self._warned_skip = False
        self._events: EventLog | None = None
        if not self._enabled:
            return

        for g in groups:
            self.canaries[g.name] = GroupCanary(g, caps_by_name[g.name], self.device, backend)
        self._kernels = _uses_kernels(backend, self.device)
        self._cuda = self.device.type == "cuda"
        # The C entry point skips the Python wrapper's checks (the host step counts microseconds).
        self._stream_capturing: Callable[[], bool] = getattr(
            torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing
        )
        layout = Layout([config.log_rows] * len(groups))
        self._work = StepWork(list(self.canaries.values()), layout, self.device)
        self._pump = LaggedPump(self._work.outbox, layout)
        # Totals as of the last decoded step: a view of that step's host buffer (see pump.py).
        self._seen: npt.NDArray[np.int64] = np.zeros((len(groups), NUM_COUNTERS), dtype=np.int64)
        # What the per-step fast path reads: the two phase marks and each group's violation total.
        self._watch_before = layout.phase_offset + PHASE_BEFORE
        self._watch_after = layout.phase_offset + PHASE_AFTER
        self._watch_rows = [layout.totals_offset + g * NUM_COUNTERS + Counter.VIOLATIONS for g in range(len(groups))]
        self._seen_rows = [0] * len(groups)
        self._phase = PhaseCheck()
        self._health = KernelHealth(len(groups), config.health_every, config.health_warmup)
        self._log_limiter = RateLimiter(config.log_rate_limit_per_s, clock)
        self._health_limiter = RateLimiter(config.log_rate_limit_per_s, clock)
        if config.events_path is not None:
            self._events = EventLog(config.events_path, config.events_max_bytes)
        self.metrics_registry = make_registry(self._metrics_view)

    @staticmethod
    def _caps_by_name(caps: Capacities | Mapping[str, Capacities], names: list[str]) -> dict[str, Capacities]:
        if isinstance(caps, Capacities):
            return dict.fromkeys(names, caps)
        if not isinstance(caps, Mapping):
            raise TypeError(f"caps must be Capacities or a mapping of group name to Capacities, got {type(caps)}")
        missing = [n for n in names if n not in caps]
        extra = [n for n in caps if n not in names]
        if missing or extra:
            raise ValueError(f"caps must name exactly the groups {names}; missing {missing}, unknown {extra}")
        for n, c in caps.items():
            if not isinstance(c, Capacities):
                raise TypeError(f"caps[{n!r}] must be Capacities, got {type(c).__name__}")
        return dict(caps)

    # ------------------------------------------------------------------ per-step device work

    def before_forward(self, batches: Mapping[str, StepBatch]) -> None:
        """Plan, verify and stamp every group; validates everything before any device work."""
        if not self._enabled:
            return
        if self._open:
            raise RuntimeError(
                "before_forward called twice without after_forward in between; call after_forward() "
                "after each model forward (or abandon_forward() if the forward failed)"
            )
        capturing = _capturing(self.device)
        ordered = self._ordered_batches(batches)
        if capturing and not self._kernels:
            raise RuntimeError(
                "before_forward is being captured in a CUDA graph but the canary uses the reference path, "
                "which reads values on the host and would leave nothing in the graph; use Backend.AUTO/TRITON"
            )
        check_values = False if capturing else self.config.check_values  # None: the canary's device default
        validate_step(list(self.canaries.values()), ordered, check_values)
        self._work.before(ordered)  # validated above
        self._open = True
        self._open_capturing = capturing

    def _ordered_batches(self, batches: Mapping[str, StepBatch]) -> list[StepBatch]:
        if not isinstance(batches, Mapping):
            raise TypeError(f"batches must be a mapping of group name to StepBatch, got {type(batches).__name__}")
        unknown = [n for n in batches if n not in self.canaries]
        missing = [n for n in self.canaries if n not in batches]
        if unknown or missing:
            raise ValueError(
                f"batches must hold one StepBatch per group {list(self.canaries)}; "
                f"unknown groups {unknown}, missing groups {missing}"
            )
        out = []
        for n in self.canaries:
            b = batches[n]
            if not isinstance(b, StepBatch):
                raise TypeError(f"batches[{n!r}] must be a StepBatch, got {type(b).__name__}")
            out.append(b)
        return out

    def after_forward(self) -> None:
        """Mark the forward done and snapshot/clear the step's log on device (graph-capturable)."""
        if not self._enabled:
            return
        if not self._open:
            raise RuntimeError("after_forward called without before_forward for this forward")
        capturing = _capturing(self.device)
        if capturing != self._open_capturing:
            raise RuntimeError(
                "before_forward and after_forward must both be inside one CUDA graph capture, or both outside"
            )
        self._work.after()
        self._open = False
        if capturing:
            self._graph_captured = True
        else:
            self._eager_forwards += 1

    def abandon_forward(self) -> None:
        """Close a before_forward whose model forward raised, so the next step starts clean.

        Eagerly, the forward's device work is closed as after_forward would (the phase marks stay
        paired; its rows are reported by the next host_step).  A failed capture is simply forgotten.
        """
        if not self._enabled or not self._open:
            return
        self._open = False
        if not self._open_capturing:
            self._work.after()
            self._eager_forwards += 1

    # ------------------------------------------------------------------ host side

    def host_step(self, request_ids: Sequence[object] | None = None) -> StepReport | None:
        """Decode the previous step's copy, stage this step's, then act (outside any graph).

        ``request_ids[r]`` is the engine's id of batch row r in this step's batches.  Returns the
        report of the previous step when it had violations (``log`` and ``fail-request`` modes), or
        None; raises :class:`CanaryViolation` in ``raise`` mode.
        """
        if not self._enabled:
            return None
        self._check_host_call("host_step")
        if self._eager_forwards == 0 and not self._graph_captured:
            raise RuntimeError(
                "host_step called without a forward: call before_forward(...) and after_forward() "
                "first (or replay a CUDA graph captured with them)"
            )
        ids = self._check_request_ids(request_ids)
        self._eager_forwards = 0
        step = self._step
        prev = self._pump.take()
        outcome = None if prev is None else self._decode(prev, reported_at=step)
        # Stage this step before acting: a raise below must not lose this step's copy.
        self._pump.stage(step, ids)
        self._step += 1
        return None if outcome is None else self._act(*outcome)

    def flush(self) -> StepReport | None:
        """Synchronously decode the last staged step (end of a run)."""
        if not self._enabled:
            return None
        self._check_host_call("flush")
        if self._eager_forwards:
            raise RuntimeError("flush: a forward ran after the last host_step; call host_step(request_ids) first")
        buf = self._pump.take()
        outcome = None if buf is None else self._decode(buf, reported_at=self._step)
        report = None if outcome is None else self._act(*outcome)
        self._log_suppressed()
        return report

    def stats(self) -> dict[str, int]:
        """Cumulative counts as of the last decoded step."""
        seen = self._seen if self._enabled else np.zeros((0, NUM_COUNTERS), dtype=np.int64)
        return {
            "steps": self._steps_decoded,
            "forwards": self._phase.before if self._enabled else 0,
            "verified_slots": int(seen[:, Counter.VERIFIED].sum()),
            "violations": int(seen[:, Counter.VIOLATIONS].sum()),
            "skipped_entries": int(seen[:, Counter.SKIPPED].sum()),
            "stamped": int(seen[:, Counter.STAMPED].sum()),
            "health_failures": sum(self._health_failures.values()),
        }

    def close(self) -> None:
        """Close the event log (the manager keeps working without it)."""
        if self._events is not None:
            self._events.close()
            self._events = None

    def _check_host_call(self, what: str) -> None:
        if self._open:
            raise RuntimeError(f"{what} called between before_forward and after_forward")
        if self._cuda and self._stream_capturing():
            raise RuntimeError(f"{what} must run outside CUDA graph capture")

    @staticmethod
    def _check_request_ids(request_ids: Sequence[object] | None) -> tuple[object, ...] | None:
        if request_ids is None:
            return None
        if type(request_ids) is list or type(request_ids) is tuple:  # the common cases, checked cheaply
            return tuple(request_ids)
        if isinstance(request_ids, (str, bytes)) or not isinstance(request_ids, Sequence):
            raise TypeError(f"request_ids must be a sequence (one id per batch row), got {type(request_ids)}")
        return tuple(request_ids)

    # ------------------------------------------------------------------ decoding and acting

    def _decode(self, buf: HostBuffer, reported_at: int) -> tuple[StepReport | None, list[Problem]] | None:
        """Decode one step's host copy and run the checks; None when there is nothing to act on.

        Counts, logs and events of failed checks happen here; raising and the violation report's
        actions are left to :meth:`_act`, after the caller staged the next copy.
        """
        buf.wait()
        flat, step = buf.flat, buf.step
        self._steps_decoded += 1
        problems: list[Problem] = []
        phase_problem = self._phase.advance(flat.item(self._watch_before), flat.item(self._watch_after))
        if phase_problem is not None:
            problems.append(("phase", None, phase_problem))
        rows = [flat.item(i) for i in self._watch_rows]
        report = self._build_report(buf, reported_at) if rows != self._seen_rows else None
        self._seen_rows = rows
        previous, self._seen = self._seen, buf.totals  # the totals stay readable until the next decode
        if self._health.due(step):
            problems.extend(self._check_kernels(previous))
        for check, group, detail in problems:
            self._record_health_failure(step, check, group, detail)
        if self.config.stats_every and (step + 1) % self.config.stats_every == 0:
            self._stats_line(step)
        if report is None and not problems:
            return None
        return report, problems

    def _build_report(self, buf: HostBuffer, reported_at: int) -> StepReport:
        delta = buf.totals - self._seen
        violations: list[Violation] = []
        counts: dict[str, int] = {}
        group_counts: dict[str, int] = {}
        total = 0
        for g, (name, log) in enumerate(zip(self.canaries, buf.logs, strict=True)):
            rows = int(delta[g, Counter.VIOLATIONS])
            if rows <= 0:
                continue
            total += rows
            group_counts[name] = rows
            for r, reason in enumerate(REASON_NAMES):
                if delta[g, r]:
                    counts[reason] = counts.get(reason, 0) + int(delta[g, r])
            violations.extend(annotate([decode_row(row, name, buf.request_ids) for row in log.rows().tolist()]))
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

    def _act(self, report: StepReport | None, problems: list[Problem]) -> StepReport | None:
        """Act on a decoded step by mode; in raise mode a violation wins over a failed check."""
        mode = self.config.mode
        if report is not None:
            if self._events is not None:
                self._events.report(report)
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

    def _log_suppressed(self) -> None:
        """End of a run: say what the rate limits held back since their last logged message."""
        for limiter, what in ((self._log_limiter, "violation report(s)"), (self._health_limiter, "health failure(s)")):
            note = limiter.suppressed_note(what)
            if note:
                logger.warning("kvcanary: %s; stats() counts every one (so does the event log, when set)", note)

    def _check_kernels(self, previous: npt.NDArray[np.int64]) -> list[Problem]:
        calls = [int(c) for c in self._seen[:, Counter.CALLS]]
        problems: list[Problem] = []
        for g in self._health.stale_groups(calls):
            name = self.groups[g].name
            detail = (
                f"canary kernels did not run for group {name!r} since the previous health check "
                f"(CALLS counter stuck at {calls[g]})"
            )
            problems.append(("kernels_ran", name, detail))
        skipped = self._seen[:, Counter.SKIPPED] - previous[:, Counter.SKIPPED]
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
        self._health_failures[check] += 1
        if self._events is not None:
            self._events.health(step, check, group, detail)
        if self.config.mode is not Mode.RAISE and self._health_limiter.allow():
            note = self._health_limiter.suppressed_note("health failure(s)")
            logger.error("kvcanary health check failed at step %d (%s): %s%s", step, check, detail, note and f" {note}")

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
        if self._events is not None:
            self._events.stats(step, {k: v for k, v in s.items() if k != "steps"})

    def _metrics_view(self) -> MetricsView:
        seen = self._seen.copy()
        groups = tuple(
            GroupTotals(
                name=g.name,
                reasons={r: int(seen[i, j]) for j, r in enumerate(REASON_NAMES)},
                rows=int(seen[i, Counter.VIOLATIONS]),
                verified=int(seen[i, Counter.VERIFIED]),
                skipped=int(seen[i, Counter.SKIPPED]),
                stamped=int(seen[i, Counter.STAMPED]),
            )
            for i, g in enumerate(self.groups)
        )
        return MetricsView(groups=groups, steps=self._steps_decoded, health_failures=dict(self._health_failures))
