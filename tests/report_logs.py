"""Event logs of real engine runs (transformers continuous batching, 8 prompts): one clean, one with a fault,
for the report and plot tests (the ``faulted_log`` and ``clean_log`` fixtures)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvcanary import CanaryConfig, Mode
from kvcanary.adapters.transformers_cb import install
from kvcanary.adapters.transformers_cb.selftest.hooks import attach_fault
from kvcanary.demo import DemoOptions, build_model, build_prompts, generate_waves, quiet_engine_logs

FAULT_AFTER = 5
OPTIONS = DemoOptions(requests=8, follow_up=0, new_tokens=8)


def engine_run(events: Path, fault: str | None, **install_options: Any) -> dict[str, Any]:
    """A short transformers run (8 prompts, 8 new tokens) with the event log on; the injected fault, if any."""
    model = build_model("dense")
    with quiet_engine_logs():
        config = CanaryConfig(mode=Mode.LOG, events_path=str(events), stats_every=4)
        canary = install(model, config, **install_options)
        injector = None if fault is None else attach_fault(canary, fault, after_step=FAULT_AFTER)
        try:
            generate_waves(model, build_prompts(OPTIONS.requests), OPTIONS)
            canary.flush()
            return {"stats": canary.stats(), "injected": None if injector is None else injector.injection}
        finally:
            if injector is not None:
                injector.detach()
            canary.uninstall()


def faulted_log_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    path = tmp_path_factory.mktemp("events") / "faulted.jsonl"
    run = engine_run(path, "slot-mapping-foreign")
    assert run["injected"] is not None and run["stats"]["violations"] > 0
    return path, run


def clean_log_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    path = tmp_path_factory.mktemp("events") / "clean.jsonl"
    run = engine_run(path, None)
    assert run["stats"]["violations"] == 0 and run["stats"]["steps"] > 8
    return path, run
