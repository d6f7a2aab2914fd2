"""The step tap on a thread of its own (``install(tap_thread=True)``, see
:mod:`kvcanary.adapters.transformers_cb.tap_thread`): the hand-off itself, and the real engine verified the same as
with the tap inline, its faults caught the same."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from kvcanary.adapters.transformers_cb.tap_thread import TapThread


def test_a_call_runs_on_the_thread_and_the_caller_waits_for_it() -> None:
    thread = TapThread()
    seen: list[int] = []
    try:
        for i in range(5):
            thread.call(lambda k: seen.append(k * 0 + threading.get_ident()), i)
            assert len(seen) == i + 1  # done before call returned
    finally:
        thread.close()
    assert len(set(seen)) == 1 and seen[0] != threading.get_ident()


def test_inference_mode_is_carried_and_a_caller_in_another_mode_runs_inline() -> None:
    thread = TapThread()
    seen: list[tuple[int, bool]] = []

    def probe() -> None:
        seen.append((threading.get_ident(), torch.is_inference_mode_enabled()))

    try:
        with torch.inference_mode():
            thread.call(probe)
        thread.call(probe)  # not in inference mode: the thread runs under it, so the call stays on this thread
    finally:
        thread.close()
    assert seen[0][0] != threading.get_ident() and seen[0][1] is True
    assert seen[1] == (threading.get_ident(), False)


def test_an_exception_is_raised_again_on_the_caller_and_the_thread_goes_on() -> None:
    thread = TapThread()

    def fail() -> None:
        raise KeyError("broken step")

    try:
        with pytest.raises(KeyError, match="broken step"):
            thread.call(fail)
        out: list[int] = []
        thread.call(out.append, 7)
        assert out == [7]
    finally:
        thread.close()


def test_close_is_idempotent_and_a_later_call_starts_a_new_thread() -> None:
    thread = TapThread()
    ids: list[int] = []
    thread.call(lambda: ids.append(threading.get_ident()))
    thread.close()
    thread.close()
    alive = {t.name for t in threading.enumerate()}
    assert "kvcanary-tap" not in alive
    thread.call(lambda: ids.append(threading.get_ident()))
    thread.close()
    assert len(ids) == 2 and threading.get_ident() not in ids


transformers = pytest.importorskip("transformers")


def test_the_engine_is_verified_the_same_with_the_tap_on_its_thread() -> None:
    from kvcanary import CanaryConfig, Mode
    from kvcanary.adapters.transformers_cb import install
    from kvcanary.demo import build_model
    from transformers_helpers import tiny_generate

    model = build_model("hybrid")
    stats = {}
    names: dict[bool, set[str]] = {False: set(), True: set()}
    for on_thread in (False, True):

        def on_step(step: int, tr: object, record: Callable[[str], None] = names[on_thread].add) -> None:
            record(threading.current_thread().name)

        with install(model, CanaryConfig(mode=Mode.LOG), tap_thread=on_thread, on_step=on_step) as canary:
            tiny_generate(model, n=6)
            canary.flush()
            stats[on_thread] = canary.stats()
        assert "kvcanary-tap" not in {t.name for t in threading.enumerate()}  # stopped by uninstall
    keys = ("steps", "verified_slots", "stamped", "violations", "adapter_errors", "health_failures")
    assert {k: stats[True][k] for k in keys} == {k: stats[False][k] for k in keys}
    assert stats[True]["steps"] > 5 and stats[True]["violations"] == 0 and stats[True]["adapter_errors"] == 0
    assert names[True] == {"kvcanary-tap"} and names[False] and "kvcanary-tap" not in names[False]


def test_a_fault_is_caught_with_the_tap_on_its_thread_and_raise_mode_raises_out_of_generate() -> None:
    from kvcanary import CanaryConfig, Mode
    from kvcanary.adapters.transformers_cb import install
    from kvcanary.adapters.transformers_cb.selftest.hooks import attach_fault
    from kvcanary.demo import build_model
    from transformers_helpers import tiny_generate

    model = build_model("dense")
    with install(model, CanaryConfig(mode=Mode.LOG), tap_thread=True) as canary:
        injector = attach_fault(canary, "slot-mapping-foreign", after_step=2, seed=0)
        try:
            tiny_generate(model, n=4)
        finally:
            injector.detach()
        canary.flush()
        assert canary.stats()["violations"] > 0 and injector.injection is not None
    with install(model, CanaryConfig(mode=Mode.RAISE), tap_thread=True) as canary:
        injector = attach_fault(canary, "slot-mapping-foreign", after_step=2, seed=0)
        try:
            with pytest.raises(Exception, match="violation"):
                tiny_generate(model, n=4)
        finally:
            injector.detach()


def test_the_tap_thread_is_off_by_default_on_the_cpu_and_a_bad_value_is_refused() -> None:
    from kvcanary import CanaryConfig, Mode
    from kvcanary.adapters.transformers_cb import install
    from kvcanary.demo import build_model

    model = build_model("dense")
    with install(model, CanaryConfig(mode=Mode.LOG)) as canary:
        assert canary._tap.thread is None  # the model is on the CPU
    with install(model, CanaryConfig(mode=Mode.LOG), tap_thread=True) as canary:
        assert canary._tap.thread is not None
    from transformers.generation.continuous_batching.model_runner import ModelRunner

    compute = ModelRunner.compute_batch
    with pytest.raises(TypeError, match="tap_thread"):
        install(model, CanaryConfig(mode=Mode.LOG), tap_thread="yes")
    assert ModelRunner.compute_batch is compute  # refused before anything was patched
