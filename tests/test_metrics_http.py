"""``/metrics`` over real HTTP on localhost while a real engine runs with a fault: the documented one-liner
(``serve_metrics(canary, port=...)``), scraped at every engine step; the counters move (steps, verified
entries) and the violation counters stay at zero until the fault is injected, then count its rows."""

from __future__ import annotations

import sys
import urllib.request
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families

from kvcanary import CanaryConfig, Mode
from kvcanary.adapters.transformers_cb import install
from kvcanary.adapters.transformers_cb.selftest.hooks import attach_fault
from kvcanary.demo import DemoOptions, build_model, build_prompts, generate_waves, quiet_engine_logs
from kvcanary.runtime import metrics

FAULT_AFTER = 6
GROUP = "full_attention"


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def violations(sample: dict[Any, float]) -> float:
    return sum(v for (name, _), v in sample.items() if name == "kvcanary_violation_rows_total")


def test_counters_move_over_http_during_a_faulted_run() -> None:
    model = build_model("dense")
    options = DemoOptions(requests=8, follow_up=0, new_tokens=8)
    scrapes: list[tuple[int, dict[Any, float]]] = []
    with quiet_engine_logs():
        canary = install(
            model, CanaryConfig(mode=Mode.LOG), on_step=lambda step, _: scrapes.append((step, scrape(url)))
        )
        server = metrics.serve_metrics(canary, port=0)  # the one-liner (port 0: any free port)
        url = server.url
        injector = attach_fault(canary, "slot-mapping-foreign", after_step=FAULT_AFTER)
        try:
            assert scrape(url) == {}  # no engine cache bound yet: nothing to report, but the endpoint answers
            generate_waves(model, build_prompts(options.requests), options)
            canary.flush()
            final = scrape(url)
            stats, injected = canary.stats(), injector.injection
        finally:
            injector.detach()
            canary.uninstall()
            server.close()
    assert injected is not None and stats["violations"] > 0 and len(scrapes) >= 10
    steps = [s.get(("kvcanary_steps_total", ()), 0.0) for _, s in scrapes]
    assert steps == sorted(steps) and steps[-1] > steps[0] >= 0  # counting up, live, while the engine runs
    verified = [s.get(("kvcanary_verified_slots_total", (("group", GROUP),)), 0.0) for _, s in scrapes]
    assert verified[-1] > verified[0]
    before = [violations(s) for step, s in scrapes if step < injected.step]
    after = [violations(s) for step, s in scrapes if step > injected.step + 1]
    assert before and all(v == 0 for v in before)  # silent while clean
    assert after and after[-1] > 0  # the fault's rows, one step behind the engine at most
    assert violations(final) == stats["violations"]
    assert final[("kvcanary_steps_total", ())] == stats["steps"]
    link = ("kvcanary_violations_total", (("group", GROUP), ("reason", "link_mismatch")))
    assert final[link] > 0
    assert final[("kvcanary_violations_total", (("group", GROUP), ("reason", "never_written")))] == 0


def test_serve_a_manager_and_stop() -> None:
    from runtime_helpers import drive, make_manager

    mgr = make_manager(Mode.LOG)
    server = metrics.serve_metrics(mgr, port=0)
    try:
        drive(mgr, 4, fault_at=2)
        mgr.flush()
        sample = scrape(server.url)
        assert sample[("kvcanary_steps_total", ())] == 4 and violations(sample) == mgr.stats()["violations"] > 0
    finally:
        server.close()
    with pytest.raises(OSError):
        scrape(server.url)  # closed: the port no longer answers


def test_serve_metrics_refuses_misuse(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="port must be an int"):
        metrics.serve_metrics(lambda: None, port=70000)
    with pytest.raises(TypeError, match="serve_metrics takes a CanaryManager"):
        metrics.serve_metrics(42, port=0)
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[metrics\]'"):
        metrics.serve_metrics(lambda: None, port=0)
