"""Install the canary on an sglang ``ModelRunner``: the seed's flow, with its reviews' fixes.

``install_canary(model_runner)`` (after ``init_memory_pool``, before CUDA-graph capture):

1. options from ``server_args`` (``--kv-canary``...); mode ``none`` installs nothing and returns None;
2. attach to the KV pool (refuses an unknown pool class, and a second attach);
3. capacities from the engine's limits; one :class:`~kvcanary.runtime.CanaryManager` per runner (a
   draft worker's runner gets its own, with token offset 1: target and draft never share state);
4. patch ``model_runner.model.forward`` with the device-side bracket (``before_forward`` /
   ``after_forward``; only the outermost call of a nested forward brackets; graph-capturable) and
   ``model_runner.forward`` with the host step (outside any graph: lagged report, log/raise/fail).

Call :meth:`SglangCanary.mark_init_finished` after warm-up and graph capture: before it, eager
forwards (dummy warm-up batches) are not checked, while forwards being captured into a CUDA graph
still record the canary's device work so that every replay runs it.
"""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from kvcanary.adapters.patching import PatchSet
from kvcanary.adapters.sglang.capacities import engine_limits, group_capacities
from kvcanary.adapters.sglang.digest_layout import pool_layouts
from kvcanary.adapters.sglang.options import SglangCanaryOptions, options_from_args
from kvcanary.adapters.sglang.pools import attach_pool
from kvcanary.adapters.sglang.ranks import sglang_group
from kvcanary.adapters.sglang.translate import EXTEND_MODES, ForwardTranslator, mode_name
from kvcanary.adapters.sglang.version import check_version
from kvcanary.runtime import CanaryHealthError, CanaryViolation, FailRequestCallback, StepReport, ranked
from kvcanary.runtime.capture import is_capturing

logger = logging.getLogger("kvcanary")

RECENT_REPORTS = 16  # reports kept on the handle for inspection (log and fail-request modes)

FEATURES = (
    "forwards",
    "extend_forwards",
    "decode_forwards",
    "target_verify_forwards",
    "draft_extend_forwards",
    "idle_forwards",
    "rows_with_prefix",
    "tokens_written",
    "skipped_before_init",
    "nested_forwards",
)


def _looks_like_forward_batch(obj: object) -> bool:
    return all(hasattr(obj, a) for a in ("forward_mode", "req_pool_indices", "out_cache_loc", "batch_size"))


def find_forward_batch(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The ForwardBatch among a forward's arguments (``forward_batch=`` or positional)."""
    fb = kwargs.get("forward_batch")
    if fb is not None and _looks_like_forward_batch(fb):
        return fb
    for a in args:
        if _looks_like_forward_batch(a):
            return a
    raise TypeError("the patched forward received no sglang ForwardBatch (forward_batch=... or positional)")


class SglangCanary:
    """The canary installed on one sglang ``ModelRunner`` (an :class:`~kvcanary.adapters.EngineAdapter`)."""

    name = "sglang"

    def __init__(
        self,
        model_runner: Any,
        options: SglangCanaryOptions,
        *,
        on_fail_request: FailRequestCallback | None = None,
    ) -> None:
        table, pool = _runner_parts(model_runner, options)
        self.runner = model_runner
        self.options = options
        self.draft = bool(getattr(model_runner, "is_draft_worker", False))
        self.device = table.device
        window = getattr(model_runner, "sliding_window_size", None)
        owner = f"{'draft' if self.draft else 'target'} runner {id(model_runner):#x}"
        self.attached = attach_pool(pool, sliding_window=window, draft=self.draft, owner=owner)
        try:
            pool_rows = int(table.shape[0]) - 1  # row 0 is sglang's padding row
            max_context = int(table.shape[1])
            max_batch, max_tokens = engine_limits(getattr(model_runner, "server_args", None), pool_rows, max_context)
            caps = {
                g.name: group_capacities(
                    g,
                    max_batch=max_batch,
                    max_tokens=max_tokens,
                    max_context=max_context,
                    log_rows=options.config.log_rows,
                    verify_entries=options.verify_entries,
                )
                for g in self.attached.groups
            }
            self.caps = caps
            self.manager = ranked.build_manager(  # ranked on sglang's TP/PP group when there are several ranks
                self.attached.groups,
                caps,
                options.config,
                device=self.device,
                backend=options.backend,
                on_fail_request=on_fail_request,
                group=sglang_group(),
            )
            self.translator = ForwardTranslator(
                self.attached, table, max_batch=max_batch, max_tokens=max_tokens, draft=self.draft
            )
            if options.config.digest is not None:  # every layer's K and V read in place (design.md §12)
                self.manager.attach_digests(pool_layouts(self.attached, options.config.digest.layers))
        except BaseException:
            self.attached.detach()
            raise
        self.init_finished = False
        self.last_report: StepReport | None = None
        self.recent_reports: collections.deque[StepReport] = collections.deque(maxlen=RECENT_REPORTS)
        self._depth = 0
        self._eager_forwards = 0
        self._graph_captured = False
        self._features = dict.fromkeys(FEATURES, 0)
        self._patches = PatchSet(exclusive=False)  # on this runner's objects; the pool attach refuses a second canary
        self.after_host_step: list[Callable[[], None]] = []  # e.g. HiCache loads whose bytes are verified now

    # ------------------------------------------------------------------ the two patches

    def patch(self) -> None:
        """Wrap ``model.forward`` (device bracket) and ``model_runner.forward`` (host step)."""
        if len(self._patches):
            raise RuntimeError("this canary is already patched into its runner")
        model = getattr(self.runner, "model", None)
        if model is None or not callable(getattr(model, "forward", None)):
            raise ValueError("model_runner.model has no forward to bracket (install after load_model)")
        self._patches.wrap(model, "forward", self.bracket)
        if callable(getattr(self.runner, "forward", None)):
            self._patches.wrap(self.runner, "forward", self._with_host_step)

    def uninstall(self) -> None:
        """Restore the patched forwards, release the pool for another attach; safe to call twice."""
        self._patches.restore()
        self.attached.detach()
        self.manager.close()

    def bracket(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        """``forward`` wrapped with before/after; only the outermost of nested calls brackets."""

        @functools.wraps(forward)
        def bracketed(*args: Any, **kwargs: Any) -> Any:
            if self._depth > 0:
                self._features["nested_forwards"] += 1
                return forward(*args, **kwargs)
            capturing = is_capturing(self.device)
            if not (self.init_finished or capturing):
                self._features["skipped_before_init"] += 1
                return forward(*args, **kwargs)
            fb = find_forward_batch(args, kwargs)
            self._depth += 1
            try:
                self.before_forward(fb)
                try:
                    out = forward(*args, **kwargs)
                except BaseException as exc:
                    self.manager.abandon_forward()
                    if not capturing:
                        self._stage_failed_forward(fb, exc)
                    raise
                self.manager.after_forward()
            finally:
                self._depth -= 1
            if capturing:
                self._graph_captured = True
            else:
                self._eager_forwards += 1
            return out

        return bracketed

    def _stage_failed_forward(self, fb: Any, exc: BaseException) -> None:
        """Stage the log of a forward that raised as its own step, so its rows keep their requests.

        The engine's exception is what propagates; a canary verdict decoded on the way (the previous
        step's, in raise mode) is attached to it as a note rather than replacing it.
        """
        try:
            self.host_step(getattr(fb, "rids", None))
        except (CanaryViolation, CanaryHealthError) as verdict:
            exc.add_note(f"kvcanary: {verdict}")

    def _with_host_step(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(forward)
        def with_host_step(*args: Any, **kwargs: Any) -> Any:
            if self.init_finished and not is_capturing(self.device):
                # Outside any graph, so that a replay reads this forward's ids (truth.py).
                self.translator.truth.fill(find_forward_batch(args, kwargs))
            out = forward(*args, **kwargs)
            if self.init_finished and (self._eager_forwards or self._graph_captured):
                fb = find_forward_batch(args, kwargs)
                if self._eager_forwards or mode_name(fb) != "IDLE":  # an IDLE replay may run no graph
                    self.host_step(getattr(fb, "rids", None))
            return out

        return with_host_step

    # ------------------------------------------------------------------ per step (also for manual hooks)

    def before_forward(self, forward_batch: Any) -> None:
        """Translate and hand the batch to the manager (EAGLE workers may call this directly)."""
        if not is_capturing(self.device):
            self.translator.truth.fill(forward_batch)  # once per ForwardBatch: free after the runner's fill
        batches = self.translator.translate(forward_batch)
        self.manager.before_forward(batches)
        self._count(forward_batch)

    def host_step(self, request_ids: list[object] | None = None) -> StepReport | None:
        """Outside any graph: stage this step's log, decode the previous one, act per the mode."""
        if request_ids is not None:
            request_ids = list(request_ids)
        self._eager_forwards = 0
        self.translator.truth.clear()  # the next forward brings its own snapshot, or none
        report = self._keep(self.manager.host_step(request_ids))
        for hook in self.after_host_step:  # outside the forward: every layer of a layer-wise load has landed
            hook()
        return report

    def flush(self) -> StepReport | None:
        return self._keep(self.manager.flush())

    def _keep(self, report: StepReport | None) -> StepReport | None:
        if report is not None:
            self.last_report = report
            self.recent_reports.append(report)
        return report

    @property
    def in_forward(self) -> bool:
        """Inside the bracketed model forward (between before_forward and after_forward)."""
        return self._depth > 0

    def mark_init_finished(self) -> None:
        """Warm-up and graph capture are done: check every forward from now on."""
        self.init_finished = True

    def stats(self) -> dict[str, int]:
        return self.manager.stats()

    def features(self) -> dict[str, int]:
        return {**self._features, "forwards_with_truth": self.translator.truth.filled_forwards}

    def _count(self, fb: Any) -> None:
        """Host-side feature counters from the batch's host mirrors (no device reads)."""
        mode = mode_name(fb)
        f = self._features
        f["forwards"] += 1
        key = {
            "DECODE": "decode_forwards",
            "TARGET_VERIFY": "target_verify_forwards",
            "DRAFT_EXTEND_V2": "draft_extend_forwards",
            "IDLE": "idle_forwards",
        }.get(mode, "extend_forwards" if mode in EXTEND_MODES else "forwards")
        if key != "forwards":
            f[key] += 1
        ids = getattr(fb, "input_ids", None)
        if isinstance(ids, torch.Tensor) and mode != "IDLE":
            f["tokens_written"] += int(ids.shape[0])
        prefix_cpu = getattr(fb, "extend_prefix_lens_cpu", None)
        if mode in EXTEND_MODES and isinstance(prefix_cpu, (list, tuple)):
            f["rows_with_prefix"] += sum(1 for p in prefix_cpu if p > 0)


def install_canary(
    model_runner: Any,
    server_args: object | None = None,
    *,
    on_fail_request: FailRequestCallback | None = None,
    allow_untested_version: bool = False,
) -> SglangCanary | None:
    """Install the canary on ``model_runner`` per its ``--kv-canary*`` options; None when off.

    Refuses (:class:`~kvcanary.adapters.base.UnsupportedEngineVersion`, nothing patched) an sglang release
    other than ``SUPPORTED_SGLANG_VERSIONS`` unless ``allow_untested_version``.
    """
    args = server_args if server_args is not None else getattr(model_runner, "server_args", None)
    options = options_from_args(args)
    if not options.enabled:
        return None
    check_version(allow_untested=allow_untested_version)
    canary = SglangCanary(model_runner, options, on_fail_request=on_fail_request)
    try:
        canary.patch()
    except BaseException:
        canary.uninstall()
        raise
    logger.info(
        "kvcanary: installed on %s runner: mode=%s groups=%s capacities=%s",
        "draft" if canary.draft else "target",
        options.config.mode.value,
        [g.name for g in canary.attached.groups],
        {n: (c.max_batch, c.max_tokens, c.verify_entries) for n, c in canary.caps.items()},
    )
    return canary


def _runner_parts(model_runner: Any, options: SglangCanaryOptions) -> tuple[torch.Tensor, object]:
    """The runner's request-to-token table and KV pool, checked with the options before any state changes."""
    if not isinstance(options, SglangCanaryOptions):
        raise TypeError(f"options must be SglangCanaryOptions, got {type(options).__name__}")
    if not options.enabled:
        raise ValueError("options.config.mode is off: use install_canary, which returns None for mode none")
    rtp = getattr(model_runner, "req_to_token_pool", None)
    table = getattr(rtp, "req_to_token", None)
    if not isinstance(table, torch.Tensor) or table.dim() != 2:
        raise TypeError(
            "model_runner.req_to_token_pool.req_to_token must be a 2-D tensor (install after init_memory_pool)"
        )
    pool = getattr(model_runner, "token_to_kv_pool", None)
    if pool is None:
        raise ValueError("model_runner.token_to_kv_pool is None: install after init_memory_pool")
    return table, pool
