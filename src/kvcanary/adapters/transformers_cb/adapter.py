"""The transformers continuous-batching adapter: one call installs it on a model, one call removes it.

Where it hooks (transformers 5.24.0, ``transformers.generation.continuous_batching``): the table
:data:`~.patches.PATCHES` lists every patched method, what it is for and whether the canary is correct
without it.  The jobs live in their own modules: the host view and the step tap (:mod:`.step_tap`),
bulk KV moves mirrored into the records -- fork copies, CPU offload and restore, by the bytes moved
(:mod:`.bulk_moves`), feature counters (:mod:`.features`), raise and fail-request through the engine
(:mod:`.modes`), the canary of each engine cache (:mod:`.binding`), kept reports (:mod:`.reports`) and
CPU offloading on hosts without an accelerator (:mod:`.cpu_offload`).  Prefix sharing, cached blocks
and de-duplication need no mirroring: a block is only shared or swapped for one whose hash chain (every
token from position 0) is equal, so its records -- token, position and a link that hashes the whole
prefix -- are equal too; the clean runs' reads of such blocks confirm it.

One adapter at a time per process: the patches are on engine classes (the wrappers ignore caches that
do not belong to the adapter's model).  A new paged cache (a new continuous-batching manager) gets a
fresh canary; totals accumulate across caches.  Call :meth:`TransformersCBAdapter.flush` after a run
(the canary reports step k at step k + 1) and :meth:`uninstall` when done.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

import torch

from kvcanary.adapters.patching import PatchSet, Wrapper
from kvcanary.adapters.reports import ReportKeeper
from kvcanary.adapters.transformers_cb import patches
from kvcanary.adapters.transformers_cb.binding import Binding, Bindings
from kvcanary.adapters.transformers_cb.bulk_moves import BulkMoveWrappers
from kvcanary.adapters.transformers_cb.cpu_offload import wrap_offloading_init
from kvcanary.adapters.transformers_cb.features import FeatureCounters, FeatureWatch
from kvcanary.adapters.transformers_cb.host_batch import HostBatch
from kvcanary.adapters.transformers_cb.modes import ModeActions
from kvcanary.adapters.transformers_cb.queued_moves import MoveCounts
from kvcanary.adapters.transformers_cb.step_tap import StepCallback, StepTap
from kvcanary.adapters.transformers_cb.version import check_version
from kvcanary.config import CanaryConfig, Mode
from kvcanary.ops import Backend
from kvcanary.runtime import CanaryManager, FailRequestCallback, StepReport

logger = logging.getLogger("kvcanary")

__all__ = ["StepCallback", "TransformersCBAdapter", "install"]


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
        queue_moves: bool = True,
    ) -> None:
        model = _model_of(model)
        config = CanaryConfig() if config is None else config
        if not isinstance(config, CanaryConfig):
            raise TypeError(f"config must be a kvcanary.CanaryConfig, got {type(config).__name__}")
        if not isinstance(backend, Backend):
            raise TypeError(f"backend must be a kvcanary.Backend, got {backend!r}")
        if max_context is not None and (not isinstance(max_context, int) or max_context <= 0):
            raise ValueError(f"max_context must be a positive int or None, got {max_context!r}")
        if not isinstance(queue_moves, bool):
            raise TypeError(f"queue_moves must be a bool, got {queue_moves!r}")
        self._queue_moves = queue_moves  # block moves queued for the step work (see Binding.create)
        self._reports = ReportKeeper(max_kept_reports)
        if config.mode is Mode.FAIL_REQUEST and on_fail_request is None:
            raise ValueError("mode fail-request needs an on_fail_request callback")
        self.engine_version = check_version(allow_untested=allow_untested_version)
        self._model = model
        self._config = config
        self._backend = backend
        self._max_context = max_context
        self._modes = ModeActions(config.mode, on_fail_request)  # what raise / fail-request do (see .modes)
        self._unpinned_cpu_offload = unpinned_cpu_offload
        self._patches = PatchSet()
        self._hook: Any = None
        self._features = FeatureCounters()
        self._bindings = Bindings(self._new_binding, self._reports.collect)
        self._tap = StepTap(
            model, config.mode, self._modes, self._bindings, self._features, self._reports.collect, on_step
        )
        self._moves = BulkMoveWrappers(lambda: self._bindings.current, self._features)
        self._move_counts = MoveCounts()  # the bindings' queued moves (see queued_moves)

    # ------------------------------------------------------------------ install / uninstall

    def install(self) -> TransformersCBAdapter:
        if len(self._patches) or self._hook is not None:
            raise RuntimeError("this adapter is already installed")
        try:
            self._apply_patches()
            self._hook = self._model.register_forward_pre_hook(self._tap.pre_hook, with_kwargs=True)
        except BaseException:
            self._patches.restore()
            raise
        return self

    def uninstall(self) -> None:
        """Flush the last step, then remove the hook and restore every patched function (idempotent)."""
        try:
            self._bindings.retire()
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
        binding = self._bindings.current
        if binding is None:
            return None
        report = binding.manager.flush()
        self._reports.collect(report)
        return report

    def check_effective(self) -> None:
        """Raise if a paged forward of the model ran without the canary's step tap."""
        tap = self._tap
        if tap.forwards_seen > tap.taps or tap.hook_misses:
            raise RuntimeError(
                f"kvcanary is not in effect: {tap.forwards_seen} paged forwards ran but the step tap ran "
                f"{tap.taps} times (ModelRunner.compute_batch was bypassed)"
            )

    def stats(self) -> dict[str, int]:
        return {
            **self._bindings.stats(), "reports": self._reports.total, **self._tap.stats(),
            "mirror_us": self._moves.mirror_ns // 1000, **self._move_counts.as_dict(),
        }  # fmt: skip

    def features(self) -> dict[str, int]:
        return self._features.as_dict()

    @property
    def reports(self) -> list[StepReport]:
        """The first ``max_kept_reports`` reports with violations (all reports are counted in stats)."""
        return list(self._reports.kept)

    @property
    def first_report_step(self) -> int | None:
        """The canary step of the first violation seen, or None."""
        return self._reports.first_step

    @property
    def metrics_registry(self) -> object | None:
        """The current engine cache's Prometheus registry (None before the first step or without
        prometheus-client); serve it with ``kvcanary.runtime.metrics.serve_metrics(adapter)``."""
        manager = self.manager
        return None if manager is None else manager.metrics_registry

    @property
    def pending_batch(self) -> HostBatch | None:
        """The host batch of the step being run (for fault injection and debugging)."""
        return None if self._tap.pending is None else self._tap.pending[1]

    def set_input_probe(self, probe: Callable[[dict[str, Any]], None] | None) -> None:
        """Call ``probe(kwargs)`` with each step's forward kwargs just before the engine runs the step.

        For fault injection: the probe may edit the index tensors in place, and the forward -- eager,
        compiled or a CUDA-graph replay of those static buffers -- then uses them.
        """
        if probe is not None and not callable(probe):
            raise TypeError(f"probe must be callable or None, got {type(probe).__name__}")
        self._tap.input_probe = probe

    @property
    def next_step(self) -> int:
        """The canary step number the next verified forward will get (as in :attr:`StepReport.step`)."""
        binding = self._bindings.current
        return 0 if binding is None else binding.steps

    @property
    def manager(self) -> CanaryManager | None:
        binding = self._bindings.current
        return None if binding is None else binding.manager

    # ------------------------------------------------------------------ patches and bindings

    def _wrappers(self) -> dict[tuple[str, str], Wrapper]:
        """The wrapper factory of each patch in :data:`~.patches.PATCHES`, by (class, method)."""
        moves = self._moves
        watch = FeatureWatch(lambda: self._bindings.current, self._features)
        return {
            ("ContinuousBatchingIOs", "prepare_batch_tensors"): self._tap.wrap_prepare,
            ("ModelRunner", "compute_batch"): self._tap.wrap_compute,
            ("CacheAllocator", "copy_blocks"): moves.copy_blocks,
            ("PagedAttentionCache", "perform_cache_copy"): moves.cache_copy,
            ("OffloadingManager", "_offload_to_cpu"): moves.offload,
            ("OffloadingManager", "restore_scheduled_requests"): moves.restore,
            ("BlockLedger", "register_new_hash"): watch.register_new_hash,
            ("BlockLedger", "acquire"): watch.acquire,
            ("PagedAttentionCache", "search_prefix_match"): watch.search_prefix_match,
            ("PagedAttentionCache", "prepare_fork_request"): watch.prepare_fork_request,
            ("ContinuousBatchProcessor", "update_batch"): self._modes.wrap_update_batch(self._owns_cache),
            ("ContinuousMixin", "generate_batch"): self._modes.wrap_generate_batch(self._is_model, self.flush),
            ("OffloadingManager", "__init__"): lambda orig: wrap_offloading_init(orig, sys.modules[orig.__module__]),
        }

    def _apply_patches(self) -> None:
        active = {patches.When.ALWAYS}
        if self._config.mode is Mode.FAIL_REQUEST:
            active.add(patches.When.FAIL_REQUEST)
        elif self._config.mode is Mode.RAISE:
            active.add(patches.When.RAISE)
        if self._unpinned_cpu_offload:
            active.add(patches.When.UNPINNED_OFFLOAD)
        wanted = [p for p in patches.PATCHES if p.when in active]
        owners = {p: p.resolve() for p in wanted}
        broken = [p for p, owner in owners.items() if owner is None]
        critical = [p.symbol for p in broken if p.role is patches.Role.CRITICAL]
        if critical:
            raise RuntimeError(
                f"kvcanary: this transformers ({self.engine_version}) lacks what the canary must patch: {critical}"
            )
        for p in broken:
            if p.role is patches.Role.SAVING:
                logger.warning("kvcanary: %s is missing; no %s (the canary is as correct)", p.symbol, p.purpose)
            else:
                logger.warning("kvcanary: %s is missing; the %s counter stays 0", p.symbol, p.purpose)
        wrappers = self._wrappers()
        for p, owner in owners.items():
            if owner is not None:
                self._patches.wrap(owner, p.method, wrappers[(p.owner, p.method)])

    def _new_binding(self, runner: Any) -> Binding:
        binding = Binding.create(
            runner,
            self._config,
            backend=self._backend,
            max_context=self._max_context,
            max_positions=getattr(self._model.config, "max_position_embeddings", None),
            on_fail_request=self._modes.manager_callback,
            move_counts=self._move_counts,
            queue_moves=self._queue_moves,
        )
        self._moves.bound(binding)
        return binding

    def _is_model(self, model: Any) -> bool:
        return model is self._model

    def _owns_cache(self, cache: Any) -> bool:
        binding = self._bindings.current
        return binding is not None and binding.is_for(cache)


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


def install(model: Any, config: CanaryConfig | None = None, **options: Any) -> TransformersCBAdapter:
    """Install the canary on ``model`` -- a transformers model (used with ``generate_batch``,
    ``init_continuous_batching`` or ``continuous_batching_context_manager``) or a
    ``ContinuousBatchingManager`` -- and return its handle; ``options`` are
    :class:`TransformersCBAdapter`'s keyword arguments.  Install before the manager starts its loop."""
    return TransformersCBAdapter(model, config, **options).install()
