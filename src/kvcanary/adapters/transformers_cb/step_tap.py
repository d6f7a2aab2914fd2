"""The per-step work of the transformers adapter: the host view, the step tap and the bypass check.

* ``ContinuousBatchingIOs.prepare_batch_tensors``: the host's view of the step (request ids, past and
  query lengths, ground-truth tokens), read just before the engine advances the requests.
* ``ModelRunner.compute_batch``: right after the engine launched the forward, the kwargs the model
  received are translated and handed to the :class:`~kvcanary.runtime.CanaryManager` on the engine's
  compute stream.  Running after the launch keeps the tap outside compiled code and CUDA graphs (the
  static buffers the graph replayed are the ones read) and sees the carried-over tokens of asynchronous
  batching; the records only change through the canary, so nothing is lost by verifying after the
  forward was enqueued.
* a forward pre-hook on the model only counts paged forwards, so a forward that ran without the tap
  (the engine changed its call path) is noticed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from kvcanary.adapters.transformers_cb.binding import Binding, Bindings
from kvcanary.adapters.transformers_cb.features import FeatureCounters
from kvcanary.adapters.transformers_cb.host_batch import HostBatch
from kvcanary.adapters.transformers_cb.modes import ModeActions
from kvcanary.adapters.transformers_cb.tap_timer import TapTimer
from kvcanary.adapters.transformers_cb.translation import Translation
from kvcanary.config import Mode
from kvcanary.runtime import StepReport, streams
from kvcanary.runtime.capture import stream_capturing_probe

logger = logging.getLogger("kvcanary")

StepCallback = Callable[[int, Translation], None]  # (steps run on the current cache, the step's translation)


class StepTap:
    """Counts and wrappers of one install's per-step path (see the module docstring)."""

    def __init__(
        self,
        model: Any,
        mode: Mode,
        modes: ModeActions,
        bindings: Bindings,
        features: FeatureCounters,
        collect: Callable[[StepReport | None], None],
        on_step: StepCallback | None,
    ) -> None:
        self._model = model
        self._mode = mode
        self._modes = modes
        self._bindings = bindings
        self._features = features
        self._collect = collect
        self._on_step = on_step
        self.pending: tuple[Any, HostBatch] | None = None  # (cache, host batch) of the step being prepared
        self.input_probe: Callable[[dict[str, Any]], None] | None = None
        self.forwards_seen = 0
        self.taps = 0
        self.adapter_errors = 0
        self.hook_misses = 0
        self.timer = TapTimer()  # host time of verified steps (the device work is asynchronous on GPU)
        # Asked before every forward: torch's wrappers read the environment and look the device up each call.
        self._capturing = stream_capturing_probe() if torch.cuda.is_available() else None
        self._warned_long_rows = False

    def wrap_prepare(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def prepare_batch_tensors(io: Any, requests_in_batch: Any, *args: Any, **kwargs: Any) -> Any:
            # Before the engine advances position_offset: past lengths are read here.
            if self._mode is not Mode.OFF:
                start = time.perf_counter_ns()
                self.pending = (io.cache, HostBatch.from_future_states(requests_in_batch))
                self.timer.capture_ns = time.perf_counter_ns() - start
            return original(io, requests_in_batch, *args, **kwargs)

        return prepare_batch_tensors

    def wrap_compute(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def compute_batch(runner: Any, model: Any, batch_data: dict[str, Any]) -> Any:
            if self.input_probe is not None and model is self._model:
                self.input_probe(batch_data)
            out = original(runner, model, batch_data)
            if model is self._model:
                try:
                    self._tap(runner, batch_data)
                except Exception as exc:  # raise mode: the engine's thread swallows it, generate_batch re-raises
                    self._modes.note_raised(exc)
                    raise
            return out

        return compute_batch

    def pre_hook(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        if kwargs.get("cache") is None or "write_index" not in kwargs:
            return  # not a paged continuous-batching forward
        self.forwards_seen += 1
        if self.forwards_seen - 1 > self.taps:
            # A second forward since the last tap.  Asked only here (a CUDA call on every forward otherwise): the
            # engine capturing a CUDA graph, whose warm-up forward was counted already; the tap follows.
            if self._capturing is not None and self._capturing():
                self.forwards_seen -= 1
                return
            self.hook_misses += 1
            msg = (
                "kvcanary: a paged forward ran without the canary's step tap (ModelRunner.compute_batch was "
                "bypassed); the canary is not in effect"
            )
            if self._mode is Mode.RAISE:
                error = RuntimeError(msg)
                self._modes.note_raised(error)
                raise error
            if self.hook_misses == 1:
                logger.error(msg)
            self.taps = self.forwards_seen - 1  # report each miss once

    def _tap(self, runner: Any, batch_data: dict[str, Any]) -> None:
        self.taps += 1
        pending, self.pending = self.pending, None
        if self._mode is Mode.OFF:
            return
        # The timed phases cover the whole tap (its stream switch and checks counted in the translation and the
        # host step), so that what the timer reports is what the tap costs, not only its main calls.
        cpu = time.thread_time_ns() if self.timer.cpu_next else -1  # the CPU time is counted from here
        setup = self._bindings.setup_ns
        entered = time.perf_counter_ns()
        # Everything runs on the engine's compute stream: ordered after the forward (and the carry-over of
        # asynchronous batching) and before the next step rewrites the static buffers.  The host step too:
        # its copy of the step's counters must queue behind the canary's work, not race it on another
        # stream (the engine's streams do not synchronise with the default one).
        with streams.StreamSwitch(getattr(runner.inputs_and_outputs, "compute_stream", None)):
            verified = self._verify_step(runner, batch_data, pending)
            binding = self._bindings.current  # bound by _verify_step
            if verified is None or binding is None:
                return
            tr, (translated, launched) = verified
            entered += self._bindings.setup_ns - setup  # a binding made by this step: set-up, counted apart (setup_us)
            start = time.perf_counter_ns()
            report = binding.manager.host_step(tr.request_ids)  # a tuple: handed on as it is
        binding.steps += 1
        end = time.perf_counter_ns()
        self.timer.commit((entered, translated, launched, cpu), start, end, time.thread_time_ns() if cpu >= 0 else -1)
        self._collect(report)
        if self._on_step is not None:
            self._on_step(binding.steps, tr)

    def _verify_step(
        self, runner: Any, batch_data: dict[str, Any], pending: Any
    ) -> tuple[Translation, tuple[int, int]] | None:
        """Translate the step and run plan/verify/stamp; None when the step is not verified, else the translation and
        the clock's readings at the translation's end and the launches' end."""
        try:
            if pending is None or pending[0] is not runner.cache:
                raise RuntimeError("the forward ran without a host batch prepared for its cache")
            host = pending[1]
            if host.is_warmup:
                self._features.warmup_steps += 1
                return None
            binding = self._bind(runner)
            steady = binding.translator.steady_steps
            tr = binding.translator.translate(batch_data, host, defer=True)
        except Exception as exc:
            self._adapter_error("could not translate the step", exc)
            return None
        translated = time.perf_counter_ns()
        moves = binding.moves  # the block moves since the last step, queued for this step's work
        try:
            # On CUDA: one replay of the canary's own step graph, the translation's launches included.
            binding.manager.forward_step(tr.batches, tr.prelude if moves is None else moves.prelude(tr.prelude))
        except Exception as exc:
            binding.translator.forget_truth()  # the prelude, and the truth's write in it, may not have run
            self._adapter_error("the canary refused the step's batch", exc)
            return None  # the queued moves stay queued: the next step's work applies them
        if moves is not None:
            moves.taken()
        self._features.steady_steps += binding.translator.steady_steps - steady
        self._count(tr)
        return tr, (translated, time.perf_counter_ns())

    def _bind(self, runner: Any) -> Binding:
        binding, created = self._bindings.bind(runner)
        if created:
            self._modes.reset()
            self._features.caches_bound += 1
        return binding

    def _count(self, tr: Translation) -> None:
        f = self._features
        f.ring_wraps += tr.ring_wraps
        f.padded_steps += int(tr.padded)
        f.block_table_steps += int(tr.block_table)
        f.rows_too_long += tr.rows_too_long
        if tr.rows_too_long and not self._warned_long_rows:
            self._warned_long_rows = True
            logger.warning(
                "kvcanary: %d request(s) are longer than the adapter's table (max_context) and are not verified; "
                "pass a larger max_context to install()",
                tr.rows_too_long,
            )

    def _adapter_error(self, what: str, exc: Exception) -> None:
        """A bug or an unsupported engine state: raise in raise mode, else log (first time) and skip the step."""
        self.adapter_errors += 1
        if self._mode is Mode.RAISE:
            raise exc
        if self.adapter_errors == 1:
            logger.error("kvcanary transformers adapter: %s; the step is not verified", what, exc_info=exc)

    def stats(self) -> dict[str, int]:
        return {
            "adapter_errors": self.adapter_errors,
            "hook_misses": self.hook_misses,
            "taps": self.taps,
            **self.timer.stats(),
        }
