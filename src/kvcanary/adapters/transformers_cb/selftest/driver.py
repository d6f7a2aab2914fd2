"""The transformers self-test driver: one run of continuous batching with the canary on, fault hooks and
the read oracle (:class:`TransformersDriver`, the :class:`~kvcanary.selftest.protocol.EngineDriver`).

The workload reuses the demo's model and prompt builders (:mod:`.workload`), scaled down so a run takes
about a second on one CPU core yet still exercises what the faults need: chunked prefills (prompts longer
than the batch's token budget), prefix hits and de-duplication, forks (two sequences per prompt), CPU
offload and restore (a cache too small for all requests) and, on the hybrid model, a sliding-window ring
that wraps around.  Sampling is top-1: deterministic, so a faulted run is identical to its clean control up
to the injection (forks need ``do_sample=True``; top-1 keeps it greedy).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from kvcanary.adapters.transformers_cb.selftest.catalogue import FAULTS
from kvcanary.adapters.transformers_cb.selftest.context import FaultContext
from kvcanary.adapters.transformers_cb.selftest.hooks import FaultHooks
from kvcanary.adapters.transformers_cb.selftest.workload import (
    PAGE_SIZE,
    build_model,
    build_prompts,
    engine_configs,
    quiet_engine_logs,
)
from kvcanary.config import CanaryConfig, DigestConfig, Mode
from kvcanary.selftest.outcome import run_outcome, verdict_settled
from kvcanary.selftest.protocol import EngineDriver, InjectMode, RunOutcome, RunSpec
from kvcanary.selftest.read_oracle import ReadOracle


@dataclasses.dataclass(frozen=True)
class Workload:
    kind: str
    prompts: int = 10
    new_tokens: int = 10
    num_blocks: int = 24
    max_batch_tokens: int = 32  # below the longest prompts: prefills are split into chunks
    max_requests_per_batch: int = 8

    def __post_init__(self) -> None:
        if self.kind not in WORKLOAD_KINDS:
            raise ValueError(f"kind must be one of {', '.join(WORKLOAD_KINDS)}, got {self.kind!r}")

    def configs(self, seed: int) -> tuple[Any, Any]:
        return engine_configs(
            self.kind, self.new_tokens, seed, None, num_blocks=self.num_blocks,
            max_batch_tokens=self.max_batch_tokens, max_requests_per_batch=self.max_requests_per_batch, top_k=1,
        )  # fmt: skip


WORKLOAD_KINDS = ("dense", "hybrid")
WORKLOADS: dict[str, Workload] = {k: Workload(k) for k in WORKLOAD_KINDS}


class TransformersDriver(EngineDriver):
    """The self-test of the transformers adapter (see :class:`~kvcanary.selftest.protocol.EngineDriver`)."""

    name = "transformers"
    faults = FAULTS
    workloads = WORKLOAD_KINDS
    version_module = "kvcanary.adapters.transformers_cb.version"
    needs = "the transformers self-test needs transformers 5.24.0"
    title = "transformers {version} continuous batching"

    def __init__(self) -> None:
        self.models: dict[str, torch.nn.Module] = {}

    @contextlib.contextmanager
    def session(self, kinds: Sequence[str]) -> Iterator[None]:
        self.models = {k: build_model(k, seed=0) for k in kinds}
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # tiny models: threads only add contention on a shared CI core
        try:
            with quiet_engine_logs():
                yield
        finally:
            torch.set_num_threads(threads)
            self.models = {}

    def run(self, spec: RunSpec) -> RunOutcome:
        return run_engine(self.models.get(spec.kind) or build_model(spec.kind, seed=0), spec)


def run_engine(model: torch.nn.Module, spec: RunSpec, *, check_from: int | None = None) -> RunOutcome:
    """Run the workload of ``spec.kind`` once, as :class:`RunSpec` says; ``check_from``: the oracle checks reads
    from this step on instead of from the injection (tests validate the oracle with it)."""
    from kvcanary.adapters.transformers_cb import install

    workload = WORKLOADS[spec.kind]
    gen, cb = workload.configs(spec.seed)
    prompts = build_prompts(workload.prompts, spec.seed)
    cfg: Any = getattr(model, "config", None)
    oracle = ReadOracle(spec.store, int(cfg.num_hidden_layers))
    oracle.check_from = check_from  # normally set by the injection; tests force it to validate the oracle
    # The KV digest at budget 1.0: every read slot's bytes are checked each step (the byte faults, design.md §12).
    adapter = install(model, CanaryConfig(mode=Mode.LOG, digest=DigestConfig(budget=1.0)), max_kept_reports=8)
    ctx = FaultContext(adapter, spec.mode, rng=spec.rng(), target=spec.target, page_size=PAGE_SIZE)
    hooks = FaultHooks(ctx, spec.faults, oracle)
    try:
        hooks.attach()
        if spec.mode is InjectMode.INJECT:
            ctx.after_update(lambda: _maybe_stop(ctx, oracle, adapter))
        start = time.perf_counter()
        results, stopped = _generate(model, prompts, gen, cb, workload.new_tokens, ctx)
        seconds = time.perf_counter() - start
        adapter.flush()
        errors = _run_errors(adapter, results, len(prompts) * 2, stopped)
        return run_outcome(
            ctx, oracle, stats=adapter.stats(), features=adapter.features(), reports=adapter.reports,
            seconds=seconds, errors=errors, stopped_early=stopped,
        )  # fmt: skip
    finally:
        hooks.detach()
        adapter.uninstall()


def _run_errors(adapter: Any, results: list[Any], expected: int, stopped: bool) -> list[str]:
    """Engine failures (missing or failed results), adapter errors and a bypassed canary, as error lines."""
    errors: list[str] = []
    failed = [res for res in results if getattr(res, "error", None) is not None]
    if not stopped and (len(results) != expected or failed):
        errors.append(f"engine failed: {len(results)}/{expected} results, {len(failed)} failed")
    if adapter.stats()["adapter_errors"]:
        errors.append(f"adapter errors: {adapter.stats()['adapter_errors']}")
    try:
        adapter.check_effective()
    except RuntimeError as exc:
        errors.append(str(exc))
    return errors


def _generate(
    model: Any, prompts: list[list[int]], gen: Any, cb: Any, new_tokens: int, ctx: FaultContext
) -> tuple[list[Any], bool]:
    """``generate_batch``'s loop, with a way out: a hook may end the run early (:attr:`FaultContext.stop_requested`)."""
    from transformers.generation.continuous_batching.continuous_api import BackgroundThreadStatus
    from transformers.generation.continuous_batching.utils import WorkloadHints

    expected = len(prompts) * int(gen.num_return_sequences)
    hints = WorkloadHints(
        max_prompt_length=max(map(len, prompts)), max_generated_length=new_tokens, num_requests=expected
    )
    results: list[Any] = []
    with model.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cb, block=True, timeout=30, workload_hints=hints
    ) as manager:
        status = manager.background_thread_status
        rank = manager.distributed_helper.global_rank
        ctx.request_stop = lambda: status.request_stop(BackgroundThreadStatus.HARD_STOP, rank)
        with manager.pause():  # queue every request before the loop's first look: the same first batch each run
            manager.add_requests(inputs=prompts, max_new_tokens=new_tokens)
        while len(results) < expected:
            result = manager.get_result(timeout=0.02)
            if result is not None:
                if result.is_finished():
                    results.append(result)
            elif not manager.is_running():
                break
        status.request_stop(BackgroundThreadStatus.FLUSH_AND_STOP, rank)
        manager._wake_up_loop.set()  # the idle loop sleeps 0.1 s between checks; wake it to exit now
    return results, ctx.stop_requested


def _maybe_stop(ctx: FaultContext, oracle: ReadOracle, adapter: Any) -> None:
    """End a faulted run once its verdict cannot change (:meth:`ReadOracle.settled`)."""
    if ctx.stop_requested:
        return
    done = ctx.step - 1  # the step whose forward just completed; reports are known up to done - 1
    if verdict_settled(ctx, oracle, done, (r.step for r in adapter.reports)):
        ctx.stop_requested = True
        ctx.request_stop()
