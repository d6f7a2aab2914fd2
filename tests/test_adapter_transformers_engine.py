"""The transformers adapter on the real engine (transformers continuous batching on CPU).

Acceptance: the demo workload runs clean -- zero violations -- on a dense, a hybrid sliding/full and an
all-sliding model, and each run really exercised the engine features it can (asserted from the
adapter's counters); a token-index corruption is caught in both group kinds and names the request.
Prefix sharing (prefix hits, cached block reuse, in-place de-duplication) only exists for the dense
model: transformers turns it off whenever a sliding-window group exists, which the hybrid and
sliding runs also assert.
"""

from __future__ import annotations

import pytest

import compiled_build

pytest.importorskip("transformers")

import torch

from kvcanary import CanaryConfig, Mode
from kvcanary.adapters import UnsupportedEngineVersion
from kvcanary.adapters.patching import AlreadyPatched
from kvcanary.adapters.transformers_cb import install
from kvcanary.demo import (
    FOLLOW_UP,
    DemoOptions,
    RunResult,
    build_model,
    build_prompts,
    quiet_engine_logs,
    run_workload,
)
from transformers_helpers import demo_run, tiny_generate


@pytest.fixture(scope="module", params=["dense", "hybrid", "sliding"])
def clean(request: pytest.FixtureRequest) -> tuple[str, RunResult]:
    return request.param, demo_run(request.param)


def test_clean_workload_raises_no_violation(clean: tuple[str, RunResult]) -> None:
    _, run = clean
    s = run.stats
    assert run.outputs == 2 * (64 + FOLLOW_UP)  # 2 sequences a prompt, none failed
    assert s["violations"] == 0 and s["reports"] == 0, [r.block() for r in run.reports]
    assert s["adapter_errors"] == 0 and s["hook_misses"] == 0 and s["health_failures"] == 0
    assert s["steps"] > 50 and s["steps"] == s["forwards"]
    assert s["verified_slots"] > 10_000 and s["stamped"] > 2_000 and s["skipped_entries"] == 0


def test_clean_workload_exercised_the_engine_features(clean: tuple[str, RunResult]) -> None:
    kind, run = clean
    f = run.features
    assert f["forks"] > 0 and f["fork_block_copies"] > 0
    assert f["offloads"] > 0 and f["restores"] > 0
    # The canary's own host time outside the steps: the cache's canary set up once, the moves mirrored.
    assert run.stats["setup_us"] > 0 and run.stats["mirror_us"] > 0
    assert run.stats["setup_us"] + run.stats["mirror_us"] < run.seconds * 1e6
    if kind == "dense":
        assert f["prefix_hits"] > 0 and f["cached_block_reuse"] > 0 and f["dedup_swaps"] > 0
        assert f["ring_wraps"] == 0  # no sliding group
    else:
        assert f["ring_wraps"] > 0
        assert f["prefix_hits"] == f["cached_block_reuse"] == f["dedup_swaps"] == 0  # sharing off with a window


@pytest.mark.parametrize(
    ("kind", "fault", "group"),
    [
        ("dense", "slot-mapping-foreign", "full_attention"),
        ("hybrid", "window-ring-off-by-one", "sliding_attention"),
        ("hybrid", "slot-mapping-foreign", "full_attention"),
        ("sliding", "window-ring-off-by-one", "sliding_attention"),
    ],
)
def test_index_corruption_is_caught_and_names_the_request(kind: str, fault: str, group: str) -> None:
    run = demo_run(kind, fault=fault, requests=24)
    inj = run.injected
    assert inj is not None
    assert run.detected, f"{fault} in {group} not caught: {run.stats}"
    first = run.reports[0]
    assert first.step >= inj.step and run.first_detection_step == first.step
    assert first.step <= inj.step + 1  # reads are caught at once
    assert run.injected_request in first.affected_request_ids
    assert {v.group for v in first.violations} == {group}


def test_padded_batches_and_warmup_forwards_stay_silent(monkeypatch: pytest.MonkeyPatch) -> None:
    # Compile / CUDA graphs pad every batch and warm up on fake requests; force the padding on CPU.
    from transformers.generation.continuous_batching import model_runner

    init = model_runner.ModelRunner.__init__

    def padded_init(self: object, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)
        self.pad_inputs = True  # type: ignore[attr-defined]

    monkeypatch.setattr(model_runner.ModelRunner, "__init__", padded_init)
    run = demo_run("hybrid", requests=16)
    assert run.stats["violations"] == 0 and run.stats["adapter_errors"] == 0
    assert run.features["padded_steps"] > 0 and run.features["warmup_steps"] > 0


def test_uninstall_restores_every_patched_function_and_the_hook() -> None:
    from transformers.generation.continuous_batching import model_runner, offloading_manager
    from transformers.generation.continuous_batching.cache_allocators import cache_allocator

    targets = [
        (model_runner.ModelRunner, "compute_batch"),
        (offloading_manager.OffloadingManager, "__init__"),
        (cache_allocator.BlockLedger, "acquire"),
    ]
    before = [t.__dict__[n] for t, n in targets]
    model = build_model("dense")
    canary = install(model)
    with pytest.raises(AlreadyPatched):
        install(build_model("dense"))
    assert [t.__dict__[n] for t, n in targets] != before
    assert len(tiny_generate(model)) == 4
    canary.uninstall()
    canary.uninstall()
    assert [t.__dict__[n] for t, n in targets] == before
    assert not model._forward_pre_hooks
    assert canary.stats()["steps"] > 0 and canary.stats()["violations"] == 0


@compiled_build.patches("kvcanary.runtime.manager")
@pytest.mark.parametrize("cuda_layout", [False, True])
def test_the_canary_captures_its_step_graphs_at_first_sight_when_the_translator_keeps_static_buffers(
    cuda_layout: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manager is told its batches are static buffers of a bounded set of shapes exactly when the translator
    makes them so (on CUDA by default; here on the CPU as on CUDA, or not)."""
    import functools

    from kvcanary.adapters.transformers_cb import binding
    from kvcanary.adapters.transformers_cb.translate import StepTranslator
    from kvcanary.runtime import CanaryManager

    told: list[bool] = []

    class Recording(CanaryManager):
        def __init__(self, *args: object, static_batches: bool = False, **kwargs: object) -> None:
            told.append(static_batches)
            super().__init__(*args, static_batches=static_batches, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(binding, "CanaryManager", Recording)
    if cuda_layout:
        layout = functools.partial(StepTranslator, static=True, kernel=True, bucket=True)
        monkeypatch.setattr(binding, "StepTranslator", layout)
    model = build_model("dense")
    with install(model) as canary:
        tiny_generate(model)
        assert canary.stats()["steps"] > 0 and canary.stats()["violations"] == 0
    assert told == [cuda_layout]


def test_a_bypassed_step_tap_is_noticed() -> None:
    from transformers.generation.continuous_batching import model_runner

    model = build_model("dense")
    with install(model) as canary:
        wrapper = model_runner.ModelRunner.compute_batch
        model_runner.ModelRunner.compute_batch = wrapper.__kvcanary_original__  # type: ignore[attr-defined]
        try:
            tiny_generate(model)
        finally:
            model_runner.ModelRunner.compute_batch = wrapper  # type: ignore[method-assign]
        assert canary.stats()["hook_misses"] > 0
        with pytest.raises(RuntimeError, match="not in effect"):
            canary.check_effective()


def test_unsupported_transformers_versions_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    monkeypatch.setattr(transformers, "__version__", "5.23.0")
    with pytest.raises(UnsupportedEngineVersion, match=r"5\.24\.0"):
        install(build_model("dense"))
    with pytest.raises(ValueError, match="fail-request"):
        install(build_model("dense"), CanaryConfig(mode=Mode.FAIL_REQUEST), allow_untested_version=True)


@pytest.mark.interpreter
def test_the_kernel_path_is_silent_on_a_clean_run_and_catches_the_fault() -> None:
    # The GPU path (Triton kernels) on the same engine; on a CPU-only machine under the Triton interpreter.
    pytest.importorskip("kvcanary.ops.launchers")
    from kvcanary.ops import Backend

    device = "cuda" if torch.cuda.is_available() else "cpu"
    options = DemoOptions(
        model="hybrid", requests=6, follow_up=0, new_tokens=6, backend=Backend.TRITON, fault_after_step=3
    )
    model, prompts = build_model("hybrid", device=device), build_prompts(6)
    with quiet_engine_logs():
        clean = run_workload(model, prompts, options, label="triton")
        faulted = run_workload(model, prompts, options, label="triton", fault="slot-mapping-foreign")
    assert clean.stats["violations"] == 0 and clean.stats["steps"] > 5 and clean.stats["verified_slots"] > 1_000
    assert faulted.detected and faulted.reports[0].step == faulted.injected.step


def test_install_on_a_continuous_batching_manager_serving_requests() -> None:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = build_model("dense")
    gen = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=-1)
    cb = ContinuousBatchingConfig(page_size=8, num_blocks=32, max_batch_tokens=32, max_requests_per_batch=4)
    with quiet_engine_logs():
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        with install(manager) as canary:
            manager.start()
            ids = [manager.add_request(p) for p in build_prompts(6)]
            results = [manager.get_result(request_id=None, timeout=30) for _ in ids]
            manager.stop(block=True)
            canary.flush()
            stats = canary.stats()
    assert all(r is not None and r.error is None for r in results)
    assert stats["steps"] > 5 and stats["verified_slots"] > 0 and stats["violations"] == 0
    with pytest.raises(TypeError, match="ContinuousBatchingManager"):
        install(object())


def test_the_step_clock_times_every_step_and_only_steps(clean: tuple[str, RunResult]) -> None:
    """The demo's share compares the engine's steps: the clock ran in the clean run (inside its wall time), and on
    a run of its own it counts exactly the forwards the canary verified, leaves the loop's waits out and is
    removed on exit."""
    from transformers.generation.continuous_batching import continuous_api

    from kvcanary.adapters.transformers_cb.step_clock import StepClock

    kind, run = clean
    assert run.step_seconds is not None and 0 < run.step_seconds < run.seconds
    # The loop thread's CPU time in the same steps: there, and no more than the two threads could have run in them.
    assert run.step_cpu_seconds is not None and 0 < run.step_cpu_seconds < 2 * run.step_seconds
    if kind != "dense":
        return
    body = continuous_api.ContinuousBatchingManager._generation_loop_body
    model = build_model("dense")
    with install(model, CanaryConfig(mode=Mode.LOG)) as canary:
        with StepClock() as clock:
            tiny_generate(model)
        canary.flush()
        steps = canary.stats()["steps"]
    assert clock.available and clock.steps == steps > 0
    assert 0 < clock.seconds < 60 and 0 < clock.cpu_seconds < 2 * clock.seconds
    assert continuous_api.ContinuousBatchingManager._generation_loop_body is body  # restored
