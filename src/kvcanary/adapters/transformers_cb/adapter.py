"""The transformers continuous-batching adapter: one call installs it on a model, one call removes it.

Where it hooks (transformers 5.24.0, ``transformers.generation.continuous_batching``):

* ``ContinuousBatchingIOs.prepare_batch_tensors`` -- the host's view of the step (request ids, past
  and query lengths, ground-truth tokens), read just before the engine advances the requests.
* ``ModelRunner.compute_batch`` -- the step tap.  Right after the engine launched the forward, the
  kwargs the model received (``read_index``/``write_index``/``cu_seq_lens_k``/``position_ids``/
  ``input_ids`` or the ``block_table``) are translated and handed to the :class:`CanaryManager` on the
  engine's compute stream.  Running after the launch keeps the tap outside compiled code and CUDA
  graphs (the static buffers the graph replayed are the ones read) and sees the carried-over tokens of
  asynchronous batching; the records only change through the canary, so nothing is lost by verifying
  after the forward was enqueued.
* a forward pre-hook on the model -- only counts paged forwards, so a forward that ran without the tap
  (the engine changed its call path) is noticed: the adapter is then not in effect.
* bulk KV moves mirrored into the records: ``CacheAllocator.copy_blocks`` (forks),
  ``OffloadingManager._offload_to_cpu`` / ``restore_scheduled_requests`` (CPU offload and restore); the
  records follow the bytes both ways, device block -> host block -> device block (:mod:`.bulk_moves`).
* feature counters: ``search_prefix_match`` (prefix hits), ``BlockLedger.acquire`` (cached block
  reuse), ``mark_complete_blocks`` (in-place de-duplication), ``prepare_fork_request`` (forks).
  Prefix sharing, cached blocks and de-duplication need no mirroring: a block is only shared or swapped
  for one whose hash chain (every token from position 0) is equal, so its records -- token, position
  and a link that hashes the whole prefix -- are equal too; the clean runs' reads of such blocks
  confirm it.
* ``OffloadingManager.__init__`` on hosts without an accelerator: see :mod:`.cpu_offload`.

One adapter at a time per process: the patches are on engine classes (the wrappers ignore caches that
do not belong to the adapter's model).  A new paged cache (a new continuous-batching manager) gets a
fresh canary; totals accumulate across caches.  Call :meth:`TransformersCBAdapter.flush` after a run
(the canary reports step k at step k + 1) and :meth:`uninstall` when done.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from kvcanary.adapters.transformers_cb.binding import Binding
from kvcanary.adapters.transformers_cb.bulk_moves import BulkMoveWrappers
from kvcanary.adapters.transformers_cb.cpu_offload import wrap_offloading_init
from kvcanary.adapters.transformers_cb.features import FeatureCounters, FeatureWatch
from kvcanary.adapters.transformers_cb.host_batch import HostBatch
from kvcanary.adapters.transformers_cb.modes import FailRequestCallback, ModeActions
from kvcanary.adapters.transformers_cb.patches import PatchSet
from kvcanary.adapters.transformers_cb.tap_timer import TapTimer
from kvcanary.adapters.transformers_cb.translate import Translation
from kvcanary.adapters.transformers_cb.version import check_version
from kvcanary.config import CanaryConfig, Mode
from kvcanary.ops import Backend
from kvcanary.runtime import CanaryManager, StepReport

logger = logging.getLogger("kvcanary")

StepCallback = Callable[[int, Translation], None]  # (steps run on the current cache, the step's translation)

_STAT_KEYS = ("steps", "forwards", "verified_slots", "violations", "skipped_entries", "stamped", "health_failures")


class TransformersCBAdapter:
    """Handle of the canary installed on one transformers model (see the module docstring)."""

    name = "transformers-cb"

    def __init__(
        self,
        model: Any,
        config: CanaryConfig | None = None,
        *,
        backend: Backend = Backend.AUTO,
        max_context: int | None = None,
        on_fail_request: FailRequestCallback | None = None,
        on_step: StepCallback | None = None,
        unpinned_cpu_offload: bool = True,
        allow_untested_version: bool = False,
        max_kept_reports: int = 32,
    ) -> None:
        model = _model_of(model)
        config = CanaryConfig() if config is None else config
        if not isinstance(config, CanaryConfig):
            raise TypeError(f"config must be a kvcanary.CanaryConfig, got {type(config).__name__}")
        if not isinstance(backend, Backend):
            raise TypeError(f"backend must be a kvcanary.Backend, got {backend!r}")
        if max_context is not None and (not isinstance(max_context, int) or max_context <= 0):
            raise ValueError(f"max_context must be a positive int or None, got {max_context!r}")
        if max_kept_reports < 0:
            raise ValueError(f"max_kept_reports must be >= 0, got {max_kept_reports}")
        if config.mode is Mode.FAIL_REQUEST and on_fail_request is None:
            raise ValueError("mode fail-request needs an on_fail_request callback")
        self.engine_version = check_version(allow_untested=allow_untested_version)
        self._model = model
        self._config = config
        self._backend = backend
        self._max_context = max_context
        self._modes = ModeActions(config.mode, on_fail_request)  # what raise / fail-request do (see .modes)
        self._on_step = on_step
        self._unpinned_cpu_offload = unpinned_cpu_offload
        self._max_kept_reports = max_kept_reports
        self._patches = PatchSet()
        self._hook: Any = None
        self._binding: Binding | None = None
        self._pending: tuple[Any, HostBatch] | None = None
        self._features = FeatureCounters()
        self._retired = dict.fromkeys(_STAT_KEYS, 0)
        self._reports: list[StepReport] = []
        self._reports_total = 0
        self._first_report_step: int | None = None
        self._forwards_seen = 0
        self._taps = 0
        self._adapter_errors = 0
        self._hook_misses = 0
        self._timer = TapTimer()  # host time of verified steps (the device work is asynchronous on GPU)
        self._input_probe: Callable[[dict[str, Any]], None] | None = None
        self._warned_long_rows = False

    # ------------------------------------------------------------------ install / uninstall

    def install(self) -> TransformersCBAdapter:
        if len(self._patches) or self._hook is not None:
            raise RuntimeError("this adapter is already installed")
        try:
            self._apply_patches()
            self._hook = self._model.register_forward_pre_hook(self._pre_hook, with_kwargs=True)
        except BaseException:
            self._patches.restore()
            raise
        return self

    def uninstall(self) -> None:
        """Flush the last step, then remove the hook and restore every patched function (idempotent)."""
        try:
            if self._binding is not None:
                self._retire_binding()
        finally:
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
            self._patches.restore()

    def __enter__(self) -> TransformersCBAdapter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    @property
    def installed(self) -> bool:
        return self._hook is not None

    # ------------------------------------------------------------------ results

    def flush(self) -> StepReport | None:
        """Decode the last step (call after ``generate_batch`` returned, not while it runs).  In raise mode,
        first raise what the canary raised in the engine's thread and nobody re-raised yet (see :mod:`.modes`)."""
        raised = self._modes.take_raised()
        if raised is not None:
            raise raised
        if self._binding is None:
            return None
        report = self._binding.manager.flush()
        self._collect(report)
        return report

    def check_effective(self) -> None:
        """Raise if a paged forward of the model ran without the canary's step tap."""
        if self._forwards_seen > self._taps or self._hook_misses:
            raise RuntimeError(
                f"kvcanary is not in effect: {self._forwards_seen} paged forwards ran but the step tap ran "
                f"{self._taps} times (ModelRunner.compute_batch was bypassed)"
            )

    def stats(self) -> dict[str, int]:
        out = dict(self._retired)
        if self._binding is not None:
            for k, v in self._binding.manager.stats().items():
                out[k] = out.get(k, 0) + v
        out.update(
            reports=self._reports_total,
            adapter_errors=self._adapter_errors,
            hook_misses=self._hook_misses,
            taps=self._taps,
        )
        out.update(self._timer.stats())
        return out

    def features(self) -> dict[str, int]:
        return self._features.as_dict()

    @property
    def reports(self) -> list[StepReport]:
        """The first ``max_kept_reports`` reports with violations (all reports are counted in stats)."""
        return list(self._reports)

    @property
    def first_report_step(self) -> int | None:
        """The canary step of the first violation seen, or None."""
        return self._first_report_step

    @property
    def metrics_registry(self) -> object | None:
        """The current engine cache's Prometheus registry (None before the first step or without
        prometheus-client); serve it with ``kvcanary.runtime.metrics.serve_metrics(adapter)``."""
        return None if self._binding is None else self._binding.manager.metrics_registry

    @property
    def pending_batch(self) -> HostBatch | None:
        """The host batch of the step being run (for fault injection and debugging)."""
        return None if self._pending is None else self._pending[1]

    def set_input_probe(self, probe: Callable[[dict[str, Any]], None] | None) -> None:
        """Call ``probe(kwargs)`` with each step's forward kwargs just before the engine runs the step.

        For fault injection (:mod:`.faults`): the probe may edit the index tensors in place, and the
        forward -- eager, compiled or a CUDA-graph replay of those static buffers -- then uses them.
        """
        if probe is not None and not callable(probe):
            raise TypeError(f"probe must be callable or None, got {type(probe).__name__}")
        self._input_probe = probe

    @property
    def next_step(self) -> int:
        """The canary step number the next verified forward will get (as in :attr:`StepReport.step`)."""
        return 0 if self._binding is None else self._binding.steps

    @property
    def manager(self) -> CanaryManager | None:
        return None if self._binding is None else self._binding.manager

    # ------------------------------------------------------------------ patches

    def _apply_patches(self) -> None:
        from transformers.generation.continuous_batching import (
            cache,
            continuous_api,
            input_outputs,
            model_runner,
            offloading_manager,
        )
        from transformers.generation.continuous_batching.cache_allocators import cache_allocator

        p = self._patches
        p.wrap(input_outputs.ContinuousBatchingIOs, "prepare_batch_tensors", self._wrap_prepare)
        p.wrap(model_runner.ModelRunner, "compute_batch", self._wrap_compute)
        moves = BulkMoveWrappers(lambda: self._binding, self._features)
        watch = FeatureWatch(lambda: self._binding, self._features)
        p.wrap(cache_allocator.CacheAllocator, "copy_blocks", moves.copy_blocks)
        p.wrap(cache_allocator.CacheAllocator, "mark_complete_blocks", watch.mark_complete_blocks)
        p.wrap(cache_allocator.BlockLedger, "acquire", watch.acquire)
        p.wrap(cache.PagedAttentionCache, "search_prefix_match", watch.search_prefix_match)
        p.wrap(cache.PagedAttentionCache, "prepare_fork_request", watch.prepare_fork_request)
        om = offloading_manager.OffloadingManager
        p.wrap(om, "_offload_to_cpu", moves.offload)
        p.wrap(om, "restore_scheduled_requests", moves.restore)
        self._modes.patch(p, continuous_api, owns_cache=self._owns_cache, is_model=self._is_model, flush=self.flush)
        if self._unpinned_cpu_offload:
            p.wrap(om, "__init__", lambda orig: wrap_offloading_init(orig, offloading_manager))

    def _is_model(self, model: Any) -> bool:
        return model is self._model

    def _owns_cache(self, cache: Any) -> bool:
        return self._binding is not None and self._binding.is_for(cache)

    def _wrap_prepare(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def prepare_batch_tensors(io: Any, requests_in_batch: Any, *args: Any, **kwargs: Any) -> Any:
            # Before the engine advances position_offset: past lengths are read here.
            if self._config.mode is not Mode.OFF:
                start = time.perf_counter_ns()
                self._pending = (io.cache, HostBatch.from_future_states(requests_in_batch))
                self._timer.discard()  # a step prepared but never tapped is not timed
                self._timer.add("capture", time.perf_counter_ns() - start)
            return original(io, requests_in_batch, *args, **kwargs)

        return prepare_batch_tensors

    def _wrap_compute(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def compute_batch(runner: Any, model: Any, batch_data: dict[str, Any]) -> Any:
            if self._input_probe is not None and model is self._model:
                self._input_probe(batch_data)
            out = original(runner, model, batch_data)
            if model is self._model:
                try:
                    self._tap(runner, batch_data)
                except Exception as exc:  # raise mode: the engine's thread swallows it, generate_batch re-raises
                    self._modes.note_raised(exc)
                    raise
            return out

        return compute_batch

    # ------------------------------------------------------------------ per step

    def _pre_hook(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        if kwargs.get("cache") is None or "write_index" not in kwargs:
            return  # not a paged continuous-batching forward
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return  # the engine capturing a CUDA graph: its warm-up forward already counted, the tap follows
        self._forwards_seen += 1
        if self._forwards_seen - 1 > self._taps:
            self._hook_misses += 1
            msg = (
                "kvcanary: a paged forward ran without the canary's step tap (ModelRunner.compute_batch was "
                "bypassed); the canary is not in effect"
            )
            if self._config.mode is Mode.RAISE:
                error = RuntimeError(msg)
                self._modes.note_raised(error)
                raise error
            if self._hook_misses == 1:
                logger.error(msg)
            self._taps = self._forwards_seen - 1  # report each miss once

    def _tap(self, runner: Any, batch_data: dict[str, Any]) -> None:
        self._taps += 1
        pending, self._pending = self._pending, None
        if self._config.mode is Mode.OFF:
            return
        # Everything runs on the engine's compute stream: ordered after the forward (and the carry-over of
        # asynchronous batching) and before the next step rewrites the static buffers.  The host step too:
        # its copy of the step's counters must queue behind the canary's work, not race it on another
        # stream (the engine's streams do not synchronise with the default one).
        with _stream(getattr(runner.inputs_and_outputs, "compute_stream", None)):
            tr = self._verify_step(runner, batch_data, pending)
            binding = self._binding  # bound by _verify_step
            if tr is None or binding is None:
                self._timer.discard()
                return
            start = time.perf_counter_ns()
            report = binding.manager.host_step(list(tr.request_ids))
        binding.steps += 1
        self._timer.add("host_step", time.perf_counter_ns() - start)
        self._timer.commit()
        self._collect(report)
        if self._on_step is not None:
            self._on_step(binding.steps, tr)

    def _verify_step(self, runner: Any, batch_data: dict[str, Any], pending: Any) -> Translation | None:
        """Translate the step and run plan/verify/stamp; None when the step is not verified."""
        try:
            if pending is None or pending[0] is not runner.cache:
                raise RuntimeError("the forward ran without a host batch prepared for its cache")
            host = pending[1]
            if host.is_warmup:
                self._features.warmup_steps += 1
                return None
            binding = self._bind(runner)
            start = time.perf_counter_ns()
            tr = binding.translator.translate(batch_data, host)
        except Exception as exc:
            self._adapter_error("could not translate the step", exc)
            return None
        translated = time.perf_counter_ns()
        try:
            binding.manager.before_forward(tr.batches)
        except Exception as exc:
            self._adapter_error("the canary refused the step's batch", exc)
            return None
        binding.manager.after_forward()
        self._timer.add("translate", translated - start)
        self._timer.add("launch", time.perf_counter_ns() - translated)
        self._count(tr)
        return tr

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

    def _collect(self, report: StepReport | None) -> None:
        if report is None:
            return
        self._reports_total += 1
        if self._first_report_step is None:
            self._first_report_step = report.step
        if len(self._reports) < self._max_kept_reports:
            self._reports.append(report)

    def _adapter_error(self, what: str, exc: Exception) -> None:
        """A bug or an unsupported engine state: raise in raise mode, else log (first time) and skip the step."""
        self._adapter_errors += 1
        if self._config.mode is Mode.RAISE:
            raise exc
        if self._adapter_errors == 1:
            logger.error("kvcanary transformers adapter: %s; the step is not verified", what, exc_info=exc)

    # ------------------------------------------------------------------ binding

    def _bind(self, runner: Any) -> Binding:
        if self._binding is not None and self._binding.is_for(runner.cache):
            return self._binding
        if self._binding is not None:
            self._retire_binding()
        self._binding = Binding.create(
            runner,
            self._config,
            backend=self._backend,
            max_context=self._max_context,
            max_positions=getattr(self._model.config, "max_position_embeddings", None),
            on_fail_request=self._modes.manager_callback,
        )
        self._modes.reset()
        self._features.caches_bound += 1
        return self._binding

    def _retire_binding(self) -> None:
        b = self._binding
        if b is None:
            return
        try:
            self._collect(b.manager.flush())
        finally:
            for k, v in b.manager.stats().items():
                self._retired[k] = self._retired.get(k, 0) + v
            b.manager.close()
            self._binding = None


def _model_of(target: Any) -> torch.nn.Module:
    """The model of ``target``: a transformers model, or a ``ContinuousBatchingManager`` (its ``.model``)."""
    if isinstance(target, torch.nn.Module) and callable(getattr(target, "generate_batch", None)):
        return target
    inner = getattr(target, "model", None)
    if isinstance(inner, torch.nn.Module) and callable(getattr(target, "add_request", None)):
        return inner
    raise TypeError(
        "install() takes a transformers model with continuous batching (generate_batch) or a "
        f"ContinuousBatchingManager, got {type(target).__name__}"
    )


def _stream(stream: Any) -> Any:
    from transformers.generation.continuous_batching.utils import stream_context

    return stream_context(stream)


def install(model: Any, config: CanaryConfig | None = None, **options: Any) -> TransformersCBAdapter:
    """Install the canary on ``model`` -- a transformers model (used with ``generate_batch``,
    ``init_continuous_batching`` or ``continuous_batching_context_manager``) or a
    ``ContinuousBatchingManager`` -- and return its handle; ``options`` are
    :class:`TransformersCBAdapter`'s keyword arguments.  Install before the manager starts its loop."""
    return TransformersCBAdapter(model, config, **options).install()
