"""The canary inside one vLLM V1 model runner (``GPUModelRunner``, and ``CPUModelRunner`` which subclasses it).

Three wrappers on the runner object (restored by :meth:`VllmCanary.uninstall`):

* ``_update_states(scheduler_output)``: after vLLM applied it, records follow zeroed and copied blocks
  (:mod:`.moves`); requests admitted with cached tokens become same-step-reader candidates;
* ``execute_model``: marks the real steps (warm-up and profiling forwards run outside it and are not checked);
* ``_model_forward`` (inside the forward context): translate the step (:mod:`.translate`), plan/verify/stamp in
  one or more passes, run the forward, then the host step.  On a CPU device the host step is synchronous
  (decoded right away: a violation is acted on in the step that found it); on CUDA it lags one step.

Modes: ``log`` logs and never disturbs serving (canary-side errors are logged and counted, not raised);
``raise`` lets :class:`~kvcanary.runtime.CanaryViolation` out of ``execute_model``, which stops the engine with
the violation as the cause; ``fail-request`` hands the affected ids to the scheduler (:mod:`.failing`).
"""

from __future__ import annotations

import collections
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from kvcanary.adapters.patching import PatchSet
from kvcanary.adapters.reports import ReportKeeper
from kvcanary.adapters.vllm import failing, moves, translate
from kvcanary.adapters.vllm.digest_layout import group_layouts
from kvcanary.adapters.vllm.features import Features
from kvcanary.adapters.vllm.groups import VllmGroup, capacities, vllm_groups
from kvcanary.adapters.vllm.options import VllmCanaryOptions
from kvcanary.adapters.vllm.ranks import vllm_group
from kvcanary.adapters.vllm.truth import TruthTable
from kvcanary.config import Mode
from kvcanary.runtime import CanaryHealthError, CanaryViolation, FailRequestCallback, StepReport, ranked

logger = logging.getLogger("kvcanary")

_VERDICTS = (CanaryViolation, CanaryHealthError)
MAX_KEPT_REPORTS = 32  # reports kept in full for inspection; every report is counted (the manager's stats)
RECENT_STEPS = 64  # engine steps remembered for reports still in flight (the pump decodes a step or two late)


def check_runner(runner: Any) -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if not isinstance(runner, GPUModelRunner):
        raise TypeError(
            f"kvcanary: {type(runner).__name__} is not vLLM's V1 GPUModelRunner (or CPUModelRunner); the model "
            "runner V2 (VLLM_USE_V2_MODEL_RUNNER) is not supported yet"
        )
    if getattr(runner, "uses_mrope", False) or getattr(runner, "uses_xdrope_dim", 0):
        raise ValueError("kvcanary: models with multi-dimensional positions (M-RoPE) are not supported")


class VllmCanary:
    """The canary installed on one vLLM model runner (an :class:`~kvcanary.adapters.EngineAdapter`)."""

    name = "vllm"

    def __init__(
        self, runner: Any, options: VllmCanaryOptions, *, on_fail_request: FailRequestCallback | None = None
    ) -> None:
        if not options.enabled:
            raise ValueError("options.config.mode is off: nothing to install")
        check_runner(runner)
        self.runner = runner
        self.options = options
        self.mode = options.config.mode
        self.groups = vllm_groups(runner)
        self.device = runner.device
        caps = {g.canary.name: capacities(runner, g.canary, options.config.log_rows) for g in self.groups}
        self.caps = caps
        self._user_callback = on_fail_request
        self.manager = ranked.build_manager(  # ranked on vLLM's TP/PP group when there are several ranks
            [g.canary for g in self.groups], caps, options.config, device=self.device,
            backend=options.backend, on_fail_request=self._on_fail if self.mode is Mode.FAIL_REQUEST else None,
            group=vllm_group(),
        )  # fmt: skip
        if options.config.digest is not None:  # every layer's K and V, read in place (docs/design.md §12)
            self.manager.attach_digests(group_layouts(runner, self.groups, options.config.digest.layers))
            for g in self.groups:
                digest = self.manager.digest_of(g.canary.name)
                if digest is not None:
                    digest.stamp_after_forward = False  # the passes run before the forward: stamped after it
        width = min(int(runner.max_model_len), options.truth_width)
        self.truth = TruthTable(int(runner.input_batch.max_num_reqs), width, self.device)
        self.synchronous = self.device.type == "cpu"
        self.features_ = Features()
        self.last_report: StepReport | None = None
        self._kept = ReportKeeper(MAX_KEPT_REPORTS)
        self.to_fail: dict[str, str] = {}
        self.failed: set[str] = set()  # failed and still in the runner (pruned as they leave)
        # manager step (report.step) -> engine step (features "steps" - 1), for the kept reports only; the
        # recent steps' engine steps wait in a bounded window until their reports are decoded.
        self.engine_step_of: dict[int, int] = {}
        self._recent_engine_steps: collections.deque[int] = collections.deque(maxlen=RECENT_STEPS)
        self._manager_steps = 0
        self._candidates: set[str] = set()
        self._written: dict[str, Any] | None = None  # this step's batches (all rows), stamped after the forward
        self._in_step = False
        self._patches = PatchSet(exclusive=True)

    # ------------------------------------------------------------------ install / uninstall

    def patch(self) -> None:
        r = self.runner
        try:
            self._patches.wrap(r, "_update_states", self._wrap_update_states)
            self._patches.wrap(r, "execute_model", self._wrap_execute_model)
            self._patches.wrap(r, "_model_forward", self._wrap_model_forward)
            if self.mode is Mode.FAIL_REQUEST:
                self._patches.wrap(r, "sample_tokens", self._wrap_sample_tokens)
        except BaseException:
            self._patches.restore()
            raise
        r.kvcanary = self

    def uninstall(self) -> None:
        self._patches.restore()
        if getattr(self.runner, "kvcanary", None) is self:
            del self.runner.kvcanary
        self.manager.close()

    # ------------------------------------------------------------------ the wrappers

    def _wrap_update_states(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def _update_states(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(scheduler_output, *args, **kwargs)
            self._guard(self._follow_blocks, scheduler_output)
            return out

        return _update_states

    def _follow_blocks(self, so: Any) -> None:
        start = time.perf_counter()
        f = self.features_
        f.scheduler_output(so)
        zero = so.new_block_ids_to_zero or []
        copies = so.kv_cache_block_copies or []
        for g in self.groups:
            records = self.manager.canaries[g.canary.name].records
            f.add("reused_blocks", moves.count_written(g, records, moves.fresh_blocks(so, g)))
            f.add("zeroed_blocks", moves.apply_zeroing(g, records, zero))
            f.add("block_copies", moves.apply_copies(g, records, copies))
            self._verify_copied(g, copies)
        self._candidates = {r.req_id for r in so.scheduled_new_reqs if r.num_computed_tokens > 0}
        self._candidates |= set(so.scheduled_cached_reqs.resumed_req_ids)
        f.timed(start)

    def _verify_copied(self, g: VllmGroup, copies: Any) -> None:
        """With the KV digest on: the copied blocks' bytes (vLLM copied them in ``_update_states``) against
        the digests that moved with their records; the sources are remembered to name a differing layer."""
        digest = self.manager.digest_of(g.canary.name)
        moved = None if digest is None else moves.copied_slots(g, copies, self.device)
        if digest is None or moved is None:
            return
        digest.note_move(moved[1], moved[0])
        self.manager.verify_moved(g.canary.name, moved[1])

    def _wrap_execute_model(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def execute_model(*args: Any, **kwargs: Any) -> Any:
            self._in_step = True
            try:
                return original(*args, **kwargs)
            finally:
                self._in_step = False

        return execute_model

    def _wrap_model_forward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def _model_forward(*args: Any, **kwargs: Any) -> Any:
            if not self._in_step:
                return original(*args, **kwargs)
            self._in_step = False  # one check per step (nested or drafter forwards are not ours)
            start = time.perf_counter()
            last_ids = self._guard(self._before, kwargs)
            self.features_.timed(start)
            out = original(*args, **kwargs)
            if last_ids is not None:
                start = time.perf_counter()
                if self._written is not None:
                    self._guard(self.manager.stamp_digests, self._written)  # the forward wrote this step's K/V
                self._guard(self._host_step, last_ids)
                self.features_.timed(start)
                self.features_.timed_steps += 1
            return out

        return _model_forward

    def _wrap_sample_tokens(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def sample_tokens(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            if self.to_fail and failing.attach(out, self.to_fail):
                self.failed.update(self.to_fail)
                self.features_.add("failed_requests", len(self.to_fail))
                self.to_fail = {}
            return out

        return sample_tokens

    # ------------------------------------------------------------------ per step

    def _before(self, kwargs: dict[str, Any]) -> list[str]:
        """Plan, verify and stamp the step (all passes but the last are host-stepped here)."""
        from vllm.forward_context import get_forward_context

        self._written = None
        r = self.runner
        ctx = get_forward_context()
        meta, slot_maps = ctx.attn_metadata, ctx.slot_mapping
        if not isinstance(meta, dict):
            raise TypeError(f"kvcanary: attention metadata is a {type(meta).__name__}, not a dict (micro-batching?)")
        num_reqs = int(r.input_batch.num_reqs)
        req_ids = list(r.input_batch.req_ids[:num_reqs])
        num_tokens = int(r.query_start_loc.cpu[num_reqs])
        input_ids = kwargs.get("input_ids")
        if input_ids is None:
            input_ids = r.input_ids.gpu
        truth = self.truth.fill(req_ids, r.requests)
        inputs = translate.step_inputs(input_ids, kwargs.get("positions"), num_reqs, num_tokens, truth)
        views = [
            translate.group_view(meta[g.layer], (slot_maps or {}).get(g.layer), num_reqs, num_tokens)
            for g in self.groups
        ]
        self._count_rows(views[0], req_ids)
        candidates = [i for i, rid in enumerate(req_ids) if rid in self._candidates]
        plan = translate.passes(views, candidates, [g.canary.page_size for g in self.groups])
        self.features_.add("steps")
        if plan is None:
            batches = self._run_pass(views, inputs, None)
            self._written = batches if self.options.config.digest is not None else None
            return req_ids
        if self.options.config.digest is not None:  # every row's writes, stamped after the forward
            self._written = {
                g.canary.name: translate.batch_for(v, inputs, None) for g, v in zip(self.groups, views, strict=True)
            }
        self.features_.add("same_step_readers", sum(len(p) for p in plan[1:]))
        for rows in plan[:-1]:
            self._run_pass(views, inputs, rows)
            self._host_step([req_ids[i] for i in rows])
        self._run_pass(views, inputs, plan[-1])
        return [req_ids[i] for i in plan[-1]]

    def _run_pass(
        self, views: list[translate.GroupView], inputs: translate.StepInputs, rows: list[int] | None
    ) -> dict[str, Any]:
        batches = {g.canary.name: translate.batch_for(v, inputs, rows) for g, v in zip(self.groups, views, strict=True)}
        start = time.perf_counter()
        self.manager.before_forward(batches)
        self.manager.after_forward()
        self.features_.core_seconds += time.perf_counter() - start
        return batches

    def _count_rows(self, view: translate.GroupView, req_ids: list[str]) -> None:
        reqs = self.runner.requests
        prompt_lens = [len(reqs[rid].prompt_token_ids or ()) if rid in reqs else 0 for rid in req_ids]
        self.features_.rows(view.prefix_lens, view.extend_lens, prompt_lens)

    def _host_step(self, request_ids: list[str]) -> None:
        self._recent_engine_steps.append(self.features_.counts["steps"] - 1)  # a step may take several passes
        self._manager_steps += 1
        if self.failed:
            self.failed.intersection_update(self.runner.requests)
        start = time.perf_counter()
        try:
            self._keep(self.manager.host_step(list(request_ids)))
            if self.synchronous:
                self._keep(self.manager.flush())
        finally:
            self.features_.core_seconds += time.perf_counter() - start

    def _keep(self, report: StepReport | None) -> None:
        if report is None:
            return
        self.last_report = report
        kept = len(self._kept.kept)
        self._kept.collect(report)
        if len(self._kept.kept) > kept:
            back = self._manager_steps - 1 - report.step  # steps since the reported one
            recent = self._recent_engine_steps
            self.engine_step_of[report.step] = recent[-1 - back] if 0 <= back < len(recent) else -1

    @property
    def reports(self) -> list[StepReport]:
        """The first MAX_KEPT_REPORTS reports with violations (all are counted in ``stats``)."""
        return self._kept.kept

    def _guard(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run canary work; outside raise mode a canary-side error is logged, never raised into the engine."""
        try:
            return fn(*args)
        except _VERDICTS:
            raise
        except Exception:
            if self.mode is Mode.RAISE:
                raise
            self.features_.add("canary_errors")
            if self.features_.counts["canary_errors"] == 1:
                logger.exception("kvcanary: canary error (reported once; serving continues)")
            self.manager.abandon_forward()
            return None

    def _on_fail(self, request_ids: list[object], report: StepReport) -> None:
        new = [str(rid) for rid in request_ids if str(rid) not in self.failed and str(rid) not in self.to_fail]
        for rid in new:
            self.to_fail[rid] = report.summary()
        if new and self._user_callback is not None:
            self._user_callback(list(new), report)

    # ------------------------------------------------------------------ inspection

    def flush(self) -> StepReport | None:
        report = self.manager.flush()
        self._keep(report)
        return report

    def stats(self) -> dict[str, int]:
        return {**self.manager.stats(), "reports": self._kept.total}

    def features(self) -> dict[str, int]:
        return dict(self.features_.snapshot())

    def host_time_per_step_us(self) -> dict[str, float]:
        """Host time the canary added per checked step: in all, and the part spent in the core's
        plan/verify/stamp and reporting (the rest is this adapter: translation, truth, record moves)."""
        f = self.features_
        n = max(f.timed_steps, 1)
        return {"total": 1e6 * f.host_seconds / n, "core": 1e6 * f.core_seconds / n}
