"""The tap's timer: one verified step's clock readings -> the phases' totals, medians and the thread's CPU time
(read on one step in CPU_EVERY)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import compiled_build
from kvcanary.adapters.transformers_cb.tap_timer import TapTimer


def test_a_step_is_split_into_its_phases_and_an_untapped_capture_is_not_counted() -> None:
    timer = TapTimer()
    timer.capture_ns = 99_000  # a step prepared but never tapped: the next prepare overwrites it
    timer.capture_ns = 5_000
    timer.commit((1_000_000, 1_020_000, 1_023_000, 400_000), 1_030_000, 1_034_000, 428_000)
    stats = timer.stats()
    assert (stats["tap_capture_us"], stats["tap_translate_us"], stats["tap_launch_us"]) == (5, 20, 3)
    assert (stats["tap_host_step_us"], stats["tap_us"], stats["tap_cpu_us"]) == (4, 32, 28)
    assert timer.capture_ns == 0  # taken by the step
    timer.capture_ns = 1_000
    timer.commit((0, 10_000, 11_000, 0), 20_000, 21_000, 12_000)
    stats = timer.stats()
    assert stats["tap_us"] == 32 + 13 and stats["tap_capture_us"] == 6
    assert stats["tap_median_us"] == (32_000 + 13_000) // 2 // 1000 and stats["tap_median_translate_us"] == 15
    totals = {k: stats[f"tap_{k}_us"] for k in ("capture", "translate", "launch", "host_step")}
    assert totals == {"capture": 6, "translate": 30, "launch": 4, "host_step": 5}


def test_the_cpu_clock_is_read_on_one_step_in_cpu_every_and_scaled_to_every_step() -> None:
    from kvcanary.adapters.transformers_cb.tap_timer import CPU_EVERY

    timer = TapTimer()
    read = []
    for k in range(2 * CPU_EVERY + 1):
        read.append(timer.cpu_next)
        cpu = (1_000_000 * k, 1_000_000 * k + 7_000) if timer.cpu_next else (-1, -1)
        timer.commit((0, 1_000, 2_000, cpu[0]), 3_000, 4_000, cpu[1])
    assert [k for k, r in enumerate(read) if r] == [0, CPU_EVERY, 2 * CPU_EVERY]
    stats = timer.stats()
    assert stats["tap_cpu_steps"] == 3 and stats["tap_median_cpu_us"] == 7
    assert stats["tap_cpu_us"] == 7 * (2 * CPU_EVERY + 1)  # 7 us a sampled step, scaled to every step
    assert stats["tap_us"] == 3 * (2 * CPU_EVERY + 1)  # the wall clock is read on every step: 3 us each


@compiled_build.patches("kvcanary.adapters.transformers_cb.binding")
def test_a_binding_made_by_a_step_is_counted_as_set_up_not_as_that_steps_translation() -> None:
    """On the real engine: the tap's phases start at its entry, but a binding it makes (the canary's set-up for a new
    cache, reported as ``setup_us``) is taken out of the translation phase.  The set-up is slowed by 0.5 s here."""
    import time

    import pytest

    pytest.importorskip("transformers")
    from kvcanary.adapters.transformers_cb import binding, install
    from kvcanary.demo import build_model
    from transformers_helpers import tiny_generate

    original = binding.Bindings.__init__

    def slow_set_up(self: binding.Bindings, make: Callable[[Any], binding.Binding], *args: Any) -> None:
        def slow_make(runner: Any) -> binding.Binding:
            time.sleep(0.5)
            return make(runner)

        original(self, slow_make, *args)

    model = build_model("dense")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(binding.Bindings, "__init__", slow_set_up)
        with install(model) as canary:
            tiny_generate(model)
            stats = canary.stats()
    assert stats["steps"] > 0 and stats["setup_us"] >= 500_000
    assert stats["tap_translate_us"] < 250_000 and stats["tap_us"] < 500_000
