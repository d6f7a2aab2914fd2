"""What ``raise`` and ``fail-request`` do on the transformers engine.

The canary runs in the engine's generation thread, where an exception does not reach the caller:
transformers catches it, fails every request and stops the loop, and ``generate_batch`` returns the
failed outputs normally.  So in ``raise`` mode the adapter keeps the exception it raised there and
``generate_batch`` re-raises it in the caller's thread (after flushing the last step, whose report only
exists once the run is over).  Callers driving a ``ContinuousBatchingManager`` themselves see the
requests fail with the violation as their error, and :meth:`TransformersCBAdapter.flush` raises it.

In ``fail-request`` mode each affected request is failed through the engine's own path, the one it
uses for a request whose processing raised: its output is delivered with ``status FAILED`` and the
violation as ``error`` (and no generated tokens: they may have been computed from corrupt KV), then it
is cancelled, so the scheduler drops it and frees its blocks.  This happens right after the step's
``update_batch``, in the generation thread; the callback is called once per request, with the ids not
reported before.  A request that already finished when its violation was decoded (the canary reports
step k during step k + 1) was delivered already: the callback still reports it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

from kvcanary.config import Mode
from kvcanary.runtime import FailRequestCallback, StepReport
from kvcanary.runtime.report import CanaryViolation

logger = logging.getLogger("kvcanary")

REPORTED_MEMORY_STEPS = 8  # steps a reported request id is remembered (de-duplication of lagged reports)


class ModeActions:
    """The adapter's raise / fail-request state for one install (reset for each new engine cache)."""

    def __init__(self, mode: Mode, on_fail_request: FailRequestCallback | None) -> None:
        self._mode = mode
        self._user_callback = on_fail_request
        self._raised: BaseException | None = None
        self._reported: dict[object, int] = {}  # requests handed to the callback -> step of that report
        self._to_fail: dict[object, StepReport] = {}  # reported, not yet failed in the engine

    @property
    def manager_callback(self) -> FailRequestCallback | None:
        """The callback the canary's manager gets: the adapter's, which fails and de-duplicates."""
        return self._on_report if self._mode is Mode.FAIL_REQUEST else None

    def reset(self) -> None:
        """A new engine cache (a new manager): request ids start over."""
        self._reported.clear()
        self._to_fail.clear()

    def note_raised(self, exc: BaseException) -> None:
        """Keep the first exception the canary raised in the engine's thread (raise mode)."""
        if self._mode is Mode.RAISE and self._raised is None:
            self._raised = exc

    def take_raised(self) -> BaseException | None:
        exc, self._raised = self._raised, None
        return exc

    def _on_report(self, request_ids: list[object], report: StepReport) -> None:
        # A failed request leaves the batch before the next step is scheduled, so only the few reports of
        # steps already run can name it again: forgetting it later keeps this bounded by the batch size.
        horizon = report.step - REPORTED_MEMORY_STEPS
        for rid in [rid for rid, step in self._reported.items() if step < horizon]:
            del self._reported[rid]
        new = [rid for rid in dict.fromkeys(request_ids) if rid not in self._reported]
        if not new:
            return
        self._reported.update(dict.fromkeys(new, report.step))
        for rid in new:
            self._to_fail[rid] = report
        if self._user_callback is not None:
            self._user_callback(new, report)

    def fail_reported(self, processor: Any) -> None:
        """Fail, through the engine, every reported request still being served by ``processor``."""
        pending, self._to_fail = self._to_fail, {}
        scheduler = processor.scheduler
        for rid, report in pending.items():
            state = scheduler.active_requests.get(rid) or scheduler.waiting_requests.get(rid)
            if state is None:
                continue  # finished (already delivered) or gone
            state.generated_tokens = []  # computed from corrupt KV: none is returned
            processor.output_router.fail_and_deliver(state, CanaryViolation(report))
            scheduler.set_request_cancellation(rid)  # dropped and freed before the next batch is scheduled
            # As for a finished request: its blocks come back, so waiting requests may be admitted again.  The
            # engine clears this flag (set when it offloads) only when a request finishes, never on a
            # cancellation: with every active request failed after an offload, serving would stop for good.
            scheduler.block_new_requests = False
            logger.warning("kvcanary: request %r failed (fail-request mode)", rid)

    def wrap_update_batch(self, owns: Callable[[Any], bool]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Wrapper factory for ``ContinuousBatchProcessor.update_batch`` (``owns(cache)``: the adapter's); patched
        in fail-request mode only (the selftest wraps ``update_batch`` itself, in log mode)."""

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def update_batch(processor: Any, *args: Any, **kwargs: Any) -> Any:
                out = original(processor, *args, **kwargs)
                if self._to_fail and owns(processor.cache):
                    self.fail_reported(processor)
                return out

            return update_batch

        return make

    def wrap_generate_batch(
        self, is_model: Callable[[Any], bool], flush: Callable[[], object]
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Wrapper factory for ``generate_batch``: in raise mode the caller gets the canary's exception."""

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def generate_batch(model: Any, *args: Any, **kwargs: Any) -> Any:
                if self._mode is not Mode.RAISE or not is_model(model):
                    return original(model, *args, **kwargs)
                self._raised = None
                out = original(model, *args, **kwargs)
                raised = self.take_raised()
                if raised is not None:
                    with contextlib.suppress(Exception):
                        flush()  # the run's last step, decoded after the stop: the caller has its first violation
                    raise raised
                flush()  # the last step is decoded here; raises its violation, if any
                return out

            return generate_batch

        return make
