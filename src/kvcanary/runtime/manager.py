"""The per-KV-pool canary manager: the one object an engine adapter talks to.

Per engine step::

    mgr.before_forward({"full": batch, ...})   # plan, verify, stamp every group (graph-capturable)
    model.forward(...)
    mgr.after_forward()                        # phase mark, snapshot + clear of the log (graph-capturable)
    mgr.host_step(request_ids)                 # outside any graph: lagged pump, reporting

The first two may be captured once in a CUDA graph and replayed (inputs refilled in place); the
manager then sees only ``host_step`` calls and relies on the device phase marks to notice a replay
that lacks its work.  A violation of host step k is decoded and acted upon by host step k + 1 (k + 2
when the device runs behind: see :mod:`~kvcanary.runtime.pump`) or by :meth:`CanaryManager.flush`.
One before/after pair per host step gives exact attribution; several are allowed (warm-up forwards,
for instance): counts stay exact, rows of all but the last are dropped and reported as such.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from kvcanary.batch import StepBatch
from kvcanary.canary import GroupCanary, resolve_device, shared_records, uses_kernels
from kvcanary.config import CanaryConfig, Mode
from kvcanary.digest import DigestLayout
from kvcanary.digest_canary import GroupDigest
from kvcanary.layout import CanaryGroup
from kvcanary.ops import Backend
from kvcanary.runtime.buffers import Layout, StepWork
from kvcanary.runtime.capture import is_capturing, stream_capturing_probe
from kvcanary.runtime.decode import EMPTY_STATS, StepDecoder
from kvcanary.runtime.metrics import make_registry
from kvcanary.runtime.publish import can_publish
from kvcanary.runtime.pump import CopyFence, LaggedPump
from kvcanary.runtime.report import FailRequestCallback, StepReport, Violation
from kvcanary.runtime.step_graphs import GRAPH_STAT_KEYS, Prelude, StepGraphs, StepKeys, cuda_step_graphs
from kvcanary.runtime.validation import (
    caps_by_name,
    checked_groups,
    ordered_batches,
    request_id_tuple,
    validate_step,
)
from kvcanary.runtime.verdict import merge_reports
from kvcanary.workspace import Capacities

logger = logging.getLogger("kvcanary")


class CanaryManager:
    """Canary state and reporting for one KV pool (one or more groups).

    Everything is allocated here, once: each group's records and plan workspace, the live log, the
    outbox and three host buffers (pinned on CUDA).  In ``off`` mode nothing is allocated, every
    method is a no-op and :attr:`canaries` is empty.  Decoding and acting on a step's copy is
    :class:`~kvcanary.runtime.decode.StepDecoder`'s job.  ``static_batches``: the caller hands
    :meth:`forward_step` static buffers of a bounded set of shapes, so the canary's step graph of a key is
    captured the first time it is seen (see :mod:`~kvcanary.runtime.step_graphs`).  ``publish_outbox``: the step's
    device work writes the outbox into the host buffers itself, where it can (:mod:`~kvcanary.runtime.publish`).
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
        static_batches: bool = False,
        publish_outbox: bool = False,
    ) -> None:
        if not isinstance(config, CanaryConfig):
            raise TypeError(f"config must be a kvcanary.CanaryConfig, got {type(config).__name__}")
        if not isinstance(backend, Backend):
            raise TypeError(f"backend must be a kvcanary.Backend, got {backend!r}")
        groups = checked_groups(groups)
        caps_of = caps_by_name(caps, [g.name for g in groups])
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
        self.copy_fence: CopyFence | None = None  # the pump's progress, for copies on its stream (pump.CopyFence)
        if not self._enabled:
            return
        records = shared_records(self.groups, self.device)
        for g in groups:
            self.canaries[g.name] = GroupCanary(g, caps_of[g.name], self.device, backend, records.get(g.name))
        self._kernels = uses_kernels(backend, self.device)
        self._cuda = self.device.type == "cuda"
        self._stream_capturing = stream_capturing_probe()
        layout = Layout([config.log_rows] * len(groups))
        self._work = StepWork(
            list(self.canaries.values()), layout, self.device, close_kernel=self._cuda and self._kernels
        )
        publish = publish_outbox and self._kernels and can_publish(self.device)
        self._pump = LaggedPump(self._work.outbox, layout, publish=publish)
        self.copy_fence = self._pump.fence
        self._decoder = StepDecoder([g.name for g in groups], layout, config, on_fail_request, clock)
        # The canary's own graphs of a step's device work (CUDA kernels, eager engine, no host value checks).
        self._graphs: StepGraphs | None = None
        self._step_keys = StepKeys(lambda batches: ordered_batches(batches, self.canaries))  # the graphs' keys
        if self._cuda and self._kernels and not config.check_values:
            self._graphs = cuda_step_graphs(first_sight=static_batches)
        self.metrics_registry = make_registry(self._decoder.metrics_view)

    # ------------------------------------------------------------------ the KV digest

    def attach_digests(self, layouts: Mapping[str, DigestLayout]) -> None:
        """Turn on the KV digest (``config.digest``) for the named groups, reading the engine's bytes
        through ``layouts``; call once at install, before the first step (nothing to do in ``off`` mode)."""
        if not self._enabled:
            return
        if self.config.digest is None:
            raise ValueError("attach_digests needs CanaryConfig(digest=DigestConfig(...))")
        unknown = sorted(set(layouts) - set(self.canaries))
        if unknown:
            raise ValueError(f"attach_digests: unknown groups {unknown}; groups are {sorted(self.canaries)}")
        built = {name: GroupDigest(self.canaries[name], layout, self.config.digest) for name, layout in layouts.items()}
        if self._graphs is not None:
            self._graphs.clear()  # graphs captured before hold no digest work
        for i, name in enumerate(self.canaries):
            if name in built:
                self._work.digests[i] = built[name]
        self._decoder.locate = self._locate_digest

    def _locate_digest(self, violation: Violation) -> str:
        """The layer note of a digest mismatch row (reads the slot's bytes: only for reported rows)."""
        digest = self.digest_of(violation.group) if violation.group in self.canaries else None
        return "" if digest is None else digest.locate(violation.slot)

    def digest_of(self, group: str) -> GroupDigest | None:
        if not self._enabled:
            return None
        return self._work.digests[list(self.canaries).index(group)]

    def verify_moved(self, group: str, slots: torch.Tensor) -> None:
        """Verify the digests of slots whose bytes the engine just moved (copy, restore), outside any
        forward; findings are reported with the next step.  A no-op without a digest on ``group``."""
        digest = self.digest_of(group)
        if digest is None or slots.numel() == 0:
            return
        if self._open:
            raise RuntimeError("verify_moved called between before_forward and after_forward")
        digest.verify_slots(slots, self._work.logs[list(self.canaries).index(group)])

    def stamp_digests(self, batches: Mapping[str, StepBatch]) -> None:
        """Digest the slots ``batches`` wrote, for groups whose digest is stamped by the adapter
        (``GroupDigest.stamp_after_forward`` False): after the engine's forward wrote them, outside
        before/after.  The batches must be ones this step's ``before_forward`` validated (all rows)."""
        if not self._enabled:
            return
        if self._open:
            raise RuntimeError("stamp_digests called between before_forward and after_forward")
        for i, name in enumerate(self.canaries):
            digest = self._work.digests[i]
            if digest is not None and not digest.stamp_after_forward and name in batches:
                digest.stamp(batches[name], self._work.logs[i])

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
        capturing = is_capturing(self.device)
        ordered = ordered_batches(batches, self.canaries)
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

    def after_forward(self) -> None:
        """Mark the forward done and snapshot/clear the step's log on device (graph-capturable)."""
        if not self._enabled:
            return
        if not self._open:
            raise RuntimeError("after_forward called without before_forward for this forward")
        capturing = is_capturing(self.device)
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

    def forward_step(self, batches: Mapping[str, StepBatch], prelude: Prelude | None = None) -> None:
        """``before_forward(batches)`` then ``after_forward()``, for a tap that runs once the forward is enqueued.

        On CUDA, outside any capture, the pair's device work is replayed from the canary's own CUDA graph
        when this step's batch tensors sit where those of a captured step sat (same addresses, shapes,
        dtypes): one launch instead of several per group (see :mod:`~kvcanary.runtime.step_graphs`).
        ``prelude``: the adapter's device work that fills ``batches``, run first (and in the graph).  The same
        ``batches`` mapping and ``prelude`` as a recent step's (objects, not equal ones) reuse its key: an adapter
        hands them again only when nothing in them changed (the transformers adapter's steady steps).
        """
        graphs, publish = self._graphs, self._pump.publish_for(self._step)  # with a publisher: the graph publishes
        # A second forward in one host step whose outbox was published already runs eagerly, unpublished.
        second = publish is None and self._pump.publisher is not None
        if graphs is None or self._open or (self._cuda and self._stream_capturing()) or second:
            if prelude is not None:
                prelude.run()
            self.before_forward(batches)
            self.after_forward()
            return
        ordered, key = self._step_keys(batches, prelude)
        if graphs.replay(key):
            self._eager_forwards += 1
            self._pump.published_step = self._step
            return
        step_work = self._work.bound(ordered, prelude, publish)
        if graphs.first_sight:  # captured before it runs (no eager run first) and replayed; the checks run here
            validate_step(list(self.canaries.values()), ordered, self.config.check_values)
            if graphs.capture_and_replay(key, step_work):
                self._eager_forwards += 1
                self._pump.published_step = self._step
                return
        started = time.perf_counter_ns()
        if prelude is not None:
            prelude.run()
        self.before_forward(batches)
        self.after_forward()
        if publish is not None:
            publish()
        self._pump.published_step = self._step
        try:
            graphs.ran_eagerly(key, step_work, started)
        except Exception:  # a capture the driver refused: the step ran eagerly already; stay eager from now on
            logger.exception("kvcanary: capturing the canary's step graph failed; the canary runs eagerly from now on")
            self._graphs = None

    def graph_stats(self) -> dict[str, int]:
        """The canary's own graphs: steps replayed, captured and run eagerly (:meth:`StepGraphs.stats`; zero where
        not in use)."""
        return dict.fromkeys(GRAPH_STAT_KEYS, 0) if self._graphs is None else self._graphs.stats()

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
        """Decode the oldest step not yet decoded if its copy landed, stage this step's, then act (outside any
        graph).  Never waits on the device on the clean path (see :mod:`~kvcanary.runtime.pump`).

        ``request_ids[r]`` is the engine's id of batch row r in this step's batches.  Returns the report
        of the step decoded (normally the previous one, at most two back on a device that runs behind)
        when it had violations (``log`` and ``fail-request`` modes), or None; raises
        :class:`CanaryViolation` in ``raise`` mode.
        """
        if not self._enabled:
            return None
        if self._open:
            self._check_host_call("host_step")
        if self._eager_forwards == 0 and not self._graph_captured:
            raise RuntimeError(
                "host_step called without a forward: call before_forward(...) and after_forward() "
                "first (or replay a CUDA graph captured with them)"
            )
        ids = request_ids if type(request_ids) is tuple else request_id_tuple(request_ids)
        self._eager_forwards = 0
        step = self._step
        prev = self._pump.take_due(step)  # the oldest undecoded step whose copy landed (or is two steps old)
        outcome = None if prev is None else self._decoder.decode(prev, reported_at=step)
        # Stage this step before acting: a raise below must not lose this step's copy.
        self._pump.stage(step, ids)
        self._step += 1
        return None if outcome is None else self._decoder.act(*outcome)

    def flush(self) -> StepReport | None:
        """Synchronously decode the steps not yet decoded (end of a run: at most two, oldest first, each acted
        on by mode); returns their reports as one (:func:`~kvcanary.runtime.verdict.merge_reports`), or None."""
        if not self._enabled:
            return None
        self._check_host_call("flush")
        if self._eager_forwards:
            raise RuntimeError("flush: a forward ran after the last host_step; call host_step(request_ids) first")
        reports = []
        for buf in self._pump.take_all():
            outcome = self._decoder.decode(buf, reported_at=self._step)
            acted = None if outcome is None else self._decoder.act(*outcome)
            if acted is not None:
                reports.append(acted)
        self._decoder.log_suppressed()
        return merge_reports(reports) if reports else None

    def stats(self) -> dict[str, int]:
        """Cumulative counts as of the last decoded step."""
        return self._decoder.stats() if self._enabled else dict(EMPTY_STATS)

    def health_failure_counts(self) -> dict[str, int]:
        """Failed health checks so far, by check (``kernels_ran``, ``phase``), as of the last decoded step."""
        return dict(self._decoder.health_failures) if self._enabled else {"kernels_ran": 0, "phase": 0}

    def close(self) -> None:
        """Close the event log (the manager keeps working without it)."""
        if self._enabled and self._decoder.events is not None:
            self._decoder.events.close()
            self._decoder.events = None

    def _check_host_call(self, what: str) -> None:
        if self._open:
            raise RuntimeError(f"{what} called between before_forward and after_forward")
        if self._cuda and self._stream_capturing():
            raise RuntimeError(f"{what} must run outside CUDA graph capture")
