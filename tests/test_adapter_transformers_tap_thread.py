"""The step tap on a thread of its own (the adapter's ``tap_thread`` / ``tap_cpu``): it verifies and catches what the
inline tap does, runs on the worker (pinned where asked) with the engine's modes, hands its exceptions back to the
engine's thread, and a bad CPU is refused before anything is installed."""

from __future__ import annotations

import os
import threading

import pytest

pytest.importorskip("transformers")

import torch

from kvcanary import CanaryConfig, CanaryViolation, Mode
from kvcanary.adapters.transformers_cb import install
from kvcanary.adapters.transformers_cb.selftest.hooks import attach_fault
from kvcanary.adapters.transformers_cb.tap_thread import TapThread
from kvcanary.demo import build_model
from transformers_helpers import demo_run, tiny_generate

CPU = max(os.sched_getaffinity(0))  # a CPU this process may run on


def test_the_tap_on_its_own_thread_verifies_what_the_inline_tap_does() -> None:
    inline, worker = demo_run("hybrid", requests=16), demo_run("hybrid", requests=16, tap_cpu=CPU)
    for run in (inline, worker):
        assert run.stats["violations"] == 0 and run.stats["adapter_errors"] == 0 and run.stats["hook_misses"] == 0
    keys = ("steps", "verified_slots", "stamped")
    assert [worker.stats[k] for k in keys] == [inline.stats[k] for k in keys] and inline.stats["verified_slots"] > 0


def test_a_fault_is_caught_at_the_same_step_with_the_tap_on_its_own_thread() -> None:
    inline = demo_run("dense", fault="slot-mapping-foreign", requests=24)
    worker = demo_run("dense", fault="slot-mapping-foreign", requests=24, tap_thread=True)
    assert inline.detected and worker.detected
    assert worker.first_detection_step == inline.first_detection_step
    assert worker.injected_request in worker.reports[0].affected_request_ids


def test_the_tap_runs_on_the_pinned_worker_and_the_engine_thread_waits_for_it() -> None:
    model = build_model("dense")
    forwards: list[int] = []
    taps: list[tuple[int, set[int], int]] = []
    hook = model.register_forward_pre_hook(lambda *_: forwards.append(threading.get_ident()))
    on_step = lambda *_: taps.append((threading.get_ident(), os.sched_getaffinity(0), len(forwards)))  # noqa: E731
    try:
        with install(model, tap_cpu=CPU, on_step=on_step) as canary:
            assert len(tiny_generate(model)) == 4
            stats = canary.stats()
    finally:
        hook.remove()
    assert taps and stats["taps"] == len(taps) == len(forwards) and stats["violations"] == 0
    assert {ident for ident, _, _ in taps}.isdisjoint(forwards)  # never on the engine's thread
    assert all(cpus == {CPU} for _, cpus, _ in taps)
    assert [n for _, _, n in taps] == list(range(1, len(forwards) + 1))  # each step's tap before the next forward


def test_raise_mode_raises_the_violation_to_the_caller_through_the_worker() -> None:
    model = build_model("dense")
    with install(model, CanaryConfig(mode=Mode.RAISE), tap_thread=True) as canary:
        tiny_generate(model)  # clean: nothing raised
        with attach_fault(canary, "slot-mapping-foreign", after_step=2), pytest.raises(CanaryViolation):
            tiny_generate(model, n=4)


def test_a_tap_thread_hands_back_exceptions_and_the_callers_modes_and_ends_on_close() -> None:
    worker = TapThread()
    seen: list[tuple[int, bool, bool]] = []

    def record() -> None:
        seen.append((threading.get_ident(), torch.is_grad_enabled(), torch.is_inference_mode_enabled()))

    with torch.inference_mode():
        worker.run(record)
    with torch.no_grad():
        worker.run(record)
    worker.run(record)
    assert [s[1:] for s in seen] == [(False, True), (False, False), (True, False)]
    assert len({s[0] for s in seen}) == 1 and seen[0][0] != threading.get_ident()

    def fail() -> None:
        raise KeyError("from the tap")

    with pytest.raises(KeyError, match="from the tap"):
        worker.run(fail)
    worker.run(record)  # the worker outlives an exception
    thread = worker._worker
    worker.close()
    assert thread is not None and not thread.is_alive()


@pytest.mark.parametrize("cpu", [-1, True, 1.5, 1 << 20])
def test_a_cpu_the_process_cannot_run_on_is_refused_before_anything_is_installed(cpu: object) -> None:
    from transformers.generation.continuous_batching import model_runner

    before = model_runner.ModelRunner.__dict__["compute_batch"]
    model = build_model("dense")
    with pytest.raises(ValueError, match=r"cpu|CPU"):
        install(model, tap_cpu=cpu)
    assert model_runner.ModelRunner.__dict__["compute_batch"] is before and not model._forward_pre_hooks
    with install(model, tap_cpu=CPU) as canary:  # nothing was left installed
        assert canary.installed
