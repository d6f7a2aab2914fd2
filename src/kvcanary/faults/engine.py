"""One run of the transformers continuous-batching engine with the canary on, fault hooks and the oracle.

The workload reuses the demo's model and prompt builders (:mod:`kvcanary.demo`), scaled down so a run
takes about a second on one CPU core yet still exercises what the faults need: chunked prefills (prompts
longer than the batch's token budget), prefix hits and de-duplication, forks (two sequences per prompt),
CPU offload and restore (a cache too small for all requests) and, on the hybrid model, a sliding-window
ring that wraps around.  Sampling is top-1: deterministic, so a faulted run is identical to its clean
control up to the injection (forks need ``do_sample=True``; top-1 keeps it greedy).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Sequence
from typing import Any

import torch

from kvcanary.config import CanaryConfig, DigestConfig, Mode
from kvcanary.faults.base import Fault, FaultContext, Injection, InjectMode
from kvcanary.faults.oracle import AffectedRead, ReadOracle
from kvcanary.runtime import StepReport

MODEL_KINDS = ("dense", "hybrid")
_GRACE_STEPS = 3  # a faulted run stops this many (reported) steps after its verdict is known


@dataclasses.dataclass(frozen=True)
class Workload:
    kind: str
    prompts: int = 10
    new_tokens: int = 10
    num_blocks: int = 24
    max_batch_tokens: int = 32  # below the longest prompts: prefills are split into chunks
    max_requests_per_batch: int = 8

    def __post_init__(self) -> None:
        if self.kind not in MODEL_KINDS:
            raise ValueError(f"kind must be one of {', '.join(MODEL_KINDS)}, got {self.kind!r}")


WORKLOADS: dict[str, Workload] = {
    "dense": Workload("dense"),
    "hybrid": Workload("hybrid", num_blocks=24),
}


@dataclasses.dataclass
class RunOutcome:
    stats: dict[str, int]
    features: dict[str, int]
    reports: list[StepReport]
    seconds: float
    opportunities: dict[str, list[int]]
    injection: Injection | None
    affected: AffectedRead | None
    later_reads: list[int]  # steps after the first affected read whose batch holds an affected request
    store: dict[int, torch.Tensor]
    errors: list[str]  # harness errors (a fault's own code failed) and engine failures
    stopped_early: bool = False

    @property
    def violations(self) -> int:
        return int(self.stats.get("violations", 0))


def build_models(kinds: Sequence[str]) -> dict[str, torch.nn.Module]:
    from kvcanary.demo import build_model

    return {k: build_model(k, seed=0) for k in kinds}


def _configs(w: Workload, seed: int) -> tuple[Any, Any]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from kvcanary.demo import PAGE_SIZE

    gen = GenerationConfig(  # type: ignore[no-untyped-call]
        max_new_tokens=w.new_tokens, do_sample=True, top_k=1, num_return_sequences=2, eos_token_id=-1
    )
    cb = ContinuousBatchingConfig(
        page_size=PAGE_SIZE,
        num_blocks=w.num_blocks,
        max_batch_tokens=w.max_batch_tokens,
        max_requests_per_batch=w.max_requests_per_batch,
        cpu_offload_space=0.01,  # GiB: room for every offload of this workload
        seed=seed,
    )
    return gen, cb


def run_engine(
    model: torch.nn.Module,
    workload: Workload,
    seed: int,
    faults: Sequence[Fault],
    *,
    mode: InjectMode,
    target: tuple[str, int] | None = None,
    store: dict[int, torch.Tensor] | None = None,
    check_from: int | None = None,
) -> RunOutcome:
    """Run the workload once.  ``mode`` PROBE: the clean control (faults only record opportunities, the
    oracle records its reference); INJECT: ``target = (fault name, step)``, the oracle checks against
    ``store`` (the control's reference) from the injection on (or from ``check_from``)."""
    from transformers.generation.continuous_batching import continuous_api

    from kvcanary.adapters.patching import PatchSet
    from kvcanary.adapters.transformers_cb import install
    from kvcanary.demo import PAGE_SIZE, build_prompts

    gen, cb = _configs(workload, seed)
    prompts = build_prompts(workload.prompts, seed)
    cfg: Any = getattr(model, "config", None)
    oracle = ReadOracle(store, int(cfg.num_hidden_layers))
    oracle.check_from = check_from  # normally set by the injection; tests force it to validate the oracle
    # The KV digest at budget 1.0: every read slot's bytes are checked each step (the byte faults, design.md §12).
    adapter = install(model, CanaryConfig(mode=Mode.LOG, digest=DigestConfig(budget=1.0)), max_kept_reports=8)
    ctx = FaultContext(
        adapter,
        mode,
        rng=random.Random(f"{seed}:{target}"),
        target=target,
        page_size=PAGE_SIZE,
    )
    patches = PatchSet()
    errors: list[str] = []
    try:
        patches.wrap(
            continuous_api.ContinuousBatchProcessor,
            "prepare_next_batch",
            lambda orig: _bind_on_prepare(orig, ctx, faults, oracle),
        )
        patches.wrap(continuous_api.ContinuousBatchProcessor, "update_batch", lambda orig: _after_update(orig, ctx))

        def before_forward(kwargs: dict[str, Any]) -> None:
            if ctx.processor is not None and kwargs.get("cache") is ctx.cache and "write_index" in kwargs:
                ctx.run_forward_hooks(kwargs)

        adapter.set_input_probe(before_forward)  # the step's static input buffers, just before the forward
        if mode is InjectMode.INJECT:
            ctx.after_update(lambda: _maybe_stop(ctx, oracle, adapter))
        start = time.perf_counter()
        results, stopped = _generate(model, prompts, gen, cb, workload.new_tokens, ctx)
        seconds = time.perf_counter() - start
        adapter.flush()
        expected = len(prompts) * 2
        failed = [res for res in results if getattr(res, "error", None) is not None]
        if not stopped and (len(results) != expected or failed):
            errors.append(f"engine failed: {len(results)}/{expected} results, {len(failed)} failed")
        if adapter.stats()["adapter_errors"]:
            errors.append(f"adapter errors: {adapter.stats()['adapter_errors']}")
        try:
            adapter.check_effective()
        except RuntimeError as exc:
            errors.append(str(exc))
        return RunOutcome(
            stats=adapter.stats(),
            features=adapter.features(),
            reports=adapter.reports,
            seconds=seconds,
            opportunities=ctx.opportunities,
            injection=ctx.injection,
            affected=oracle.first,
            later_reads=oracle.later_reads,
            store=oracle.store,
            errors=errors + [f"harness: {type(e).__name__}: {e}" for e in ctx.errors],
            stopped_early=stopped,
        )
    finally:
        adapter.set_input_probe(None)
        patches.restore()
        adapter.uninstall()


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
    """End a faulted run once its verdict cannot change: detection and first affected read both known; or
    detected and a few more steps run without an affected read; or the affected requests ran
    ``_GRACE_STEPS`` more forwards, all reported on, without a detection."""
    inj = ctx.injection
    if inj is None or ctx.stop_requested:
        return
    done = ctx.step - 1  # the step whose forward just completed; reports are known up to done - 1
    detected = next((r.step for r in adapter.reports if r.step >= inj.step), None)
    if detected is not None and oracle.first is not None:
        stop = True
    elif detected is not None:
        stop = done >= detected + _GRACE_STEPS
    elif oracle.first is not None:
        stop = sum(s < done for s in oracle.later_reads) >= _GRACE_STEPS
    else:
        stop = False
    if stop:
        ctx.stop_requested = True
        ctx.request_stop()


def _bind_on_prepare(orig: Any, ctx: FaultContext, faults: Sequence[Fault], oracle: ReadOracle) -> Any:
    def prepare_next_batch(processor: Any, *args: Any, **kwargs: Any) -> Any:
        if ctx.processor is None:
            ctx.processor = processor
            for fault in faults:
                fault.install(ctx)
            _install_oracle(ctx, oracle)  # last: it must see what the faults made attention read
        return orig(processor, *args, **kwargs)

    return prepare_next_batch


def _after_update(orig: Any, ctx: FaultContext) -> Any:
    def update_batch(processor: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(processor, *args, **kwargs)
        if processor is ctx.processor:
            ctx.run_after_update_hooks()
        return out

    return update_batch


def _install_oracle(ctx: FaultContext, oracle: ReadOracle) -> None:
    for name, allocator in ctx.cache.cache_allocators.items():
        window = int(getattr(allocator, "sliding_window", 0) or 0) if name == "sliding_attention" else 0

        def make(inner: Any, window: int = window) -> Any:
            def update(key_states: Any, value_states: Any, layer_idx: int, read_index: Any, write_index: Any) -> Any:
                out = inner(key_states, value_states, layer_idx, read_index, write_index)
                host = ctx.host
                if oracle.check_from is None and ctx.injection is not None:
                    oracle.check_from = ctx.injection.step
                if host is not None and not host.is_warmup:
                    ctx.guard(oracle.observe)(
                        ctx.step, host, layer_idx, window, key_states, value_states,
                        int(read_index.numel()) > 0, out[0], out[1],
                    )  # fmt: skip
                return out

            return update

        ctx.wrap(allocator, "update", make)
