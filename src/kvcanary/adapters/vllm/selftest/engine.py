"""``kvcanary selftest --engine vllm``: one real in-process vLLM engine, reused by every run.

Each run resets the prefix cache, installs the canary (log mode) and the faults on the live engine, adds
the seeded workload (:mod:`kvcanary.adapters.vllm.workload`) and steps the engine to completion (a faulted
run stops a few steps after its verdict is settled, by aborting what is left through vLLM's abort path),
then restores everything.  Engine start costs about a minute on 2 cores; a run a few seconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from kvcanary.adapters.vllm.selftest.context import OracleTap, VllmInjector
from kvcanary.adapters.vllm.selftest.cow import install_relocations
from kvcanary.adapters.vllm.selftest.faults import FAULTS
from kvcanary.adapters.vllm.workload import make_workload
from kvcanary.config import CanaryConfig, DigestConfig, Mode
from kvcanary.selftest.outcome import run_outcome, verdict_settled
from kvcanary.selftest.protocol import EngineDriver, InjectMode, RunOutcome, RunSpec
from kvcanary.selftest.quiet import quiet_loggers
from kvcanary.selftest.read_oracle import ReadOracle

MAX_STEPS = 3000  # a clean run takes 100-300 steps; more means the engine stopped making progress
NUM_REQUESTS = 20
NUM_LAYERS = 2
DIGEST_BUDGET = 1.0  # the KV digest checks every read slot's bytes each step (the byte faults, design.md §12)


class VllmDriver(EngineDriver):
    name = "vllm"
    faults = FAULTS
    workloads = ("dense",)
    version_module = "kvcanary.adapters.vllm.version"
    needs = "the vLLM self-test needs vLLM 0.32.0 (see docs/vllm.md)"
    title = "vLLM {version} V1 engine (CPU model runner)"

    def __init__(self) -> None:
        self.llm: Any = None
        self.broken: str | None = None

    @contextlib.contextmanager
    def session(self, kinds: Sequence[str]) -> Iterator[None]:
        from kvcanary.adapters.vllm import tiny

        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        with tempfile.TemporaryDirectory(prefix="kvcanary-vllm-") as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                with quiet_loggers("kvcanary"):  # every faulted run logs its violations: the matrix says it all
                    self.llm = tiny.start_engine(tiny.build_model(tmp))
                    yield
            finally:
                self.llm = None

    def run(self, spec: RunSpec) -> RunOutcome:
        if self.llm is None:
            raise RuntimeError("VllmDriver.run outside session()")
        if self.broken is not None:  # an exception inside the engine left its state inconsistent
            return _failed_run(f"engine unusable after an earlier run failed: {self.broken}")
        out = run_engine(self.llm, spec)
        self.broken = next((e for e in out.errors if e.startswith(("engine:", "engine did not finish"))), None)
        return out


def _failed_run(error: str) -> RunOutcome:
    return RunOutcome(
        stats={"violations": 0}, features={}, reports=[], seconds=0.0, opportunities={}, injection=None,
        affected=None, later_reads=[], store=None, errors=[error],
    )  # fmt: skip


def run_engine(llm: Any, spec: RunSpec, *, num_requests: int = NUM_REQUESTS) -> RunOutcome:
    """One run of the seeded workload on the live engine, as :class:`RunSpec` says."""
    from kvcanary.adapters.vllm.attach import install

    oracle = ReadOracle(spec.store, NUM_LAYERS)  # before the install: a wrong store changes nothing
    llm.reset_prefix_cache()
    canary = install(llm, CanaryConfig(mode=Mode.LOG, digest=DigestConfig(budget=DIGEST_BUDGET)))
    assert canary is not None
    ctx = VllmInjector(spec.mode, rng=spec.rng(), target=spec.target, llm=llm, canary=canary)
    ctx.oracle = oracle
    tap = OracleTap(ctx, oracle)
    errors: list[str] = []
    start = time.perf_counter()
    stopped = False
    try:
        install_relocations(ctx)
        for fault in spec.faults:
            fault.install(ctx)
        tap.attach()
        workload = make_workload(spec.seed, num_requests=num_requests)
        stopped = _drive(llm, workload, spec.seed, ctx, oracle, canary, errors)
        canary.flush()
    except Exception as exc:  # an engine failure is a trial error, not a crash of the whole matrix
        errors.append(f"engine: {type(exc).__name__}: {exc}")
    finally:
        tap.detach()
        ctx.patches.restore()
        canary.uninstall()
    reports = [dataclasses.replace(r, step=canary.engine_step_of[r.step]) for r in canary.reports]
    return run_outcome(
        ctx, oracle, stats=canary.stats(), features={**canary.features(), "cow_relocations": ctx.relocations},
        reports=reports, seconds=time.perf_counter() - start, errors=errors, stopped_early=stopped,
    )  # fmt: skip


def _drive(
    llm: Any, workload: Any, seed: int, ctx: VllmInjector, oracle: ReadOracle, canary: Any, errors: list[str]
) -> bool:
    engine = llm.llm_engine
    ids = [f"s{seed}-r{i}" for i in range(len(workload.prompts))]
    for rid, prompt, params in zip(ids, workload.requests(), workload.sampling(), strict=True):
        engine.add_request(rid, prompt, params)
    stopped = False
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            return stopped
        engine.step()
        if not stopped and _settled(ctx, oracle, canary):
            stopped = True
            engine.abort_request(ids)
    sched = ctx.scheduler
    errors.append(
        f"engine did not finish in {MAX_STEPS} steps: {len(sched.running)} running, {len(sched.waiting)} waiting, "
        f"{ctx.block_pool.get_num_free_blocks()} free blocks"
    )
    engine.abort_request(ids)
    for _ in range(8):  # let the aborts through, boundedly
        if not engine.has_unfinished_requests():
            break
        engine.step()
    return True


def _settled(ctx: VllmInjector, oracle: ReadOracle, canary: Any) -> bool:
    """A faulted run's verdict cannot change any more (see the runner's rules)."""
    if ctx.mode is not InjectMode.INJECT:
        return False
    steps = (int(canary.engine_step_of[r.step]) for r in canary.reports)
    return verdict_settled(ctx, oracle, ctx.step - 1, steps)
